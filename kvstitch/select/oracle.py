"""`oracle`: selection from a full prefill (analysis / upper bound only; ProphetKV Sec. 3.1, Eq. 5, App. F).

``mode="attention"`` (default): G of ProphetKV Fig. 3 - the query-to-context attention under full
prefill, Φ̂_{Q,t}: the suffix (query) tokens attend over the *exact* context K/V, averaged over query
tokens, heads (per query head, mean within KV groups, then over groups) and all layers. The top-k of
these scores is the reference set G of the overlap ratio |S ∩ G| / |G| (`kvstitch.tasks.metrics.overlap_ratio`).

``mode="ideal"``: α_ideal(t) = ||Φ̂_{Q,t} V_t - Φ̂'_{Q,t} V'_t||_2 (Eq. 5), following App. F: Φ̂ and V from
the full prefill, Φ̂' and V' from the stitched (reuse) cache; attention averaged over heads and query
tokens per layer, V as [tokens, kv_heads * head_dim] per layer, both then averaged over layers, and
the l2 norm taken per token.

Cost: a prefill of prefix + context (the query rows are one more |Q|-token pass over that exact cache,
identical to the suffix rows of a full prefill without materialising N x N probabilities). A caller that has
just run a full prefill of the same prompt (the eval does, for every sample) gives it to the request's context
(`SelectionContext.exact_cache`) and the oracle only runs the query rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .context import SelectionContext
from .method import Selector, register
from .attention_scores import layer_mean


@register
@dataclass
class Oracle(Selector):
    name: ClassVar[str] = "oracle"
    needs_full_prefill: ClassVar[bool] = True
    mode: Literal["attention", "ideal"] = "attention"  # G of Fig. 3, or Eq. 5 / App. F (alias `oracle_ideal`)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        layout, nkv = ctx.layout, ctx.num_kv_heads
        exact = ctx.exact_context_cache()
        full_att = ctx.query_attention(cache=exact)
        if self.mode == "attention":
            return layer_mean(full_att, nkv)
        reuse_att = ctx.query_attention()
        c0, c1 = layout.context_start, layout.context_end

        def values(cache):  # mean over layers of [n, Hkv * d]
            v = torch.stack([layer.values[0, :, c0:c1].float() for layer in cache.layers]).mean(0)
            return v.permute(1, 0, 2).reshape(layout.n_context, -1)

        phi, phi_r = layer_mean(full_att, nkv), layer_mean(reuse_att, nkv)
        diff = phi[:, None] * values(exact).cpu() - phi_r[:, None] * values(ctx.cache).cpu()
        return diff.norm(dim=-1)
