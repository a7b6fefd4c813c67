"""Batched dense decode steps over several requests' caches (continuous batching, `Engine.decode_batch`).

Every request keeps its own `StitchCache` (lengths differ, nothing is padded or copied). One forward runs
the B new tokens as a batch ``[B, 1]``: embeddings, projections, RoPE (per-row positions) and MLPs are
batched GEMMs; inside each attention layer `BatchCache.update` writes row i's fresh K/V into cache i and
the attention runs per row over that row's own cache, through the same `kvstitch_attention` code path a
lone decode step takes (``ForwardPlan(q_slots=[length_i])``). A per-row mask is therefore implicit: row i
never sees another row's keys.

Exactness: a row's result equals the lone step's when the batched GEMMs give each row the numbers the
1-row GEMM gives. `batch_is_exact` checks that once per engine (the server falls back to one step per
request if it ever fails on a backend); the tests compare whole greedy answers batched vs alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .attention import ForwardPlan, kvstitch_attention
from .cache import StitchCache


@dataclass
class DecodeStep:
    """One pending dense decode step of a request: ``token`` at position ``cache.length`` over ``cache``.
    `Engine.stream_request(GenerationRequest(batch_decode=True))` yields these; the consumer runs them
    (`Engine.decode_batch`, several requests at once) and ``send``s back the step's logits ``[1, V]``."""

    cache: StitchCache
    token: int


class BatchCache(Cache):
    """A transformers `Cache` over B per-request `StitchCache`s for one batched decode step."""

    def __init__(self, caches: list[StitchCache]):
        super().__init__(layers=caches[0].layers)  # protocol only: every call below is routed per row
        self.caches = caches
        self.row_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.row_kv = [c.update(key_states[i:i + 1], value_states[i:i + 1], layer_idx)
                       for i, c in enumerate(self.caches)]  # append mode: slots None -> at each row's length
        return key_states, value_states  # unused: the attention reads `row_kv` (see `attend`)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length(layer_idx) for c in self.caches)

    def attend(self, module, query, **kwargs):
        """Per-row attention: row i's query over row i's keys, as a lone decode step computes it."""
        outs = []
        for i, (k, v) in enumerate(self.row_kv):
            n = k.shape[2]
            plan = ForwardPlan(q_slots=torch.tensor([n - 1], device=query.device))
            out, _ = kvstitch_attention(module, query[i:i + 1], k, v, kvstitch_plan=plan, **kwargs)
            outs.append(out)
        return torch.cat(outs, dim=0), None


@torch.no_grad()
def decode_batch(engine, steps: list[DecodeStep]) -> list[torch.Tensor]:
    """Run B pending decode steps in one forward -> each step's next-token logits ``[1, V]`` (float32)."""
    if len(steps) == 1:
        s = steps[0]
        return [engine.forward(s.cache, torch.tensor([s.token]), torch.tensor([s.cache.length]))]
    dev = engine.device
    ids = torch.tensor([[s.token] for s in steps], device=dev)
    pos = torch.tensor([[s.cache.length] for s in steps], device=dev)
    batch = BatchCache([s.cache for s in steps])
    out = engine.model(input_ids=ids, position_ids=pos, past_key_values=batch, use_cache=True, logits_to_keep=1,
                       kvstitch_plan=ForwardPlan(batch=batch))
    logits = out.logits[:, -1:].float()
    return [logits[i] for i in range(len(steps))]
