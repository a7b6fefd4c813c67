"""Sparse decoding over a paged, offloaded KV cache (PRKV and baselines).

```python
dec = make_decoder("prkv", kv_budget=1024, num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D)
dec.load_prefill(layer, keys, values, obs_queries)          # once per layer after prefill
dec.append(layer, k, v); out = dec.attend(layer, q, scaling)  # per layer, per step
dec.end_step()                                              # per generated token
dec.stats()
```
"""

from .decoder import SparseDecoder, make_decoder
from .policies import DECODE_POLICIES, DecodePolicy, get_policy
from .recall import attention_recall, decode_step_attention_recall, recall_summary
from .shadowkv import ShadowKVDecoder, ShadowKVPolicy  # registers "shadowkv"

__all__ = [
    "DECODE_POLICIES",
    "DecodePolicy",
    "ShadowKVDecoder",
    "ShadowKVPolicy",
    "SparseDecoder",
    "attention_recall",
    "decode_step_attention_recall",
    "get_policy",
    "make_decoder",
    "recall_summary",
]
