"""Sparse decoding over a paged, offloaded KV cache (PRKV and baselines).

```python
dec = make_decoder("prkv", kv_budget=1024, num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D)
dec = make_decoder(PRKV(static_ratio=0.5, kv_budget=1024), ...)     # a policy object, or its spec string:
dec = make_decoder("prkv(static_ratio=0.5,kv_budget=1024)", ...)     # the grammar of `kvstitch.core.spec`
dec.load_prefill(layer, keys, values, obs_queries)          # once per layer after prefill
dec.append(layer, k, v); out = dec.attend(layer, q, scaling)  # per layer, per step
dec.end_step()                                              # per generated token
dec.stats()
```
"""

from .decoder import SparseDecoder, make_decoder
from .policies import (DECODE_ALIASES, DECODE_POLICIES, DEFAULT_KV_BUDGET, PRKV, ArkVale, DecodePolicy, Dense, Quest,
                       SnapKV, is_dense, make_policy, policies, policy_budget)
from .recall import attention_recall, decode_step_attention_recall, recall_summary
from .shadowkv import ShadowKV, ShadowKVDecoder  # registers "shadowkv"

__all__ = [
    "ArkVale",
    "DECODE_ALIASES",
    "DECODE_POLICIES",
    "DEFAULT_KV_BUDGET",
    "DecodePolicy",
    "Dense",
    "PRKV",
    "Quest",
    "ShadowKV",
    "ShadowKVDecoder",
    "SnapKV",
    "SparseDecoder",
    "attention_recall",
    "decode_step_attention_recall",
    "is_dense",
    "make_decoder",
    "make_policy",
    "policies",
    "policy_budget",
    "recall_summary",
]
