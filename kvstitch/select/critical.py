"""Profiling a model's critical layers for `qcfuse`: the layers whose selection best recovers full prefill's.

QCFuse ships its critical layers as a per-model table (`blend/qcfuse_config.py:MODEL_TOP10_CRITICAL_LAYERS`,
"Model-specific Top-10 critical layers", best first) without the code that produced it. kvstitch
measures them so (a procedure of its own, in the spirit of the table: rank single layers by how good a
selection each gives alone):

1. per sample, QCFuse's own probe runs through EVERY layer (anchors of each layer, as `qcfuse` runs it);
   at each layer alone, its selection score (`qcfuse.critical_scores`: the probe queries' softmax over the
   full stitched cache, max over heads and question tokens) picks the top ``ratio`` of the context;
2. the reference set is what the same score picks under full prefill: the question over the exact cache
   (prefix + context prefilled jointly), every layer, averaged over the layers (the signal the stitched
   selection approximates);
3. a layer's recall is the share of the reference set its selection contains, averaged over the samples
   (a sliding-window layer is no candidate: its softmax cannot reach past the window, so on long contexts
   it "selects" by ties; Gemma 3's candidates are its global layers);
   the ranking (best first, ties to the shallower layer, which also makes the probe cheaper) is recorded in
   `kvstitch.models.loader.CRITICAL_LAYERS`, and `qcfuse` takes its first ``n_critical`` (3).

`scripts/profile_critical_layers.py` runs it (1 thread, a few tuning samples) and writes the table.
"""

from __future__ import annotations

import math

import torch

from .context import SelectionContext, top_k_indices
from .qcfuse import QCFuse, anchor_probe, critical_scores, probe_queries


@torch.no_grad()
def layer_recalls(engine, layout, ratio: float = 0.2, selector: QCFuse | None = None) -> torch.Tensor:
    """[L] float64: per layer, the recall of that layer's QCFuse selection against full prefill's (module doc);
    NaN for a layer that is no candidate (a sliding-window one, when the model has global layers)."""
    sel = selector or QCFuse()
    k = max(1, round(ratio * layout.n_context))
    kvs = engine.chunk_kvs(layout, anchors=sel.chunk_anchors())
    ctx = SelectionContext(engine, engine.stitch(layout, kvs), layout, k, chunks=kvs)
    n_layers = ctx.num_layers
    queries = anchor_probe(ctx, sel.anchor_keep(ctx, kvs), n_layers - 1)
    per_layer = critical_scores(ctx, ctx.cache, queries, range(n_layers), sel.reduce)
    exact = SelectionContext(engine, ctx.exact_context_cache(), layout, k)
    ref_layers = critical_scores(exact, exact.cache, probe_queries(exact, None, n_layers - 1), range(n_layers),
                                 sel.reduce)
    ref = set(top_k_indices(torch.stack(list(ref_layers.values())).mean(0), k).tolist())
    cands = candidate_layers(ctx)
    return torch.tensor([len(ref & set(top_k_indices(per_layer[i], k).tolist())) / k if i in cands else math.nan
                         for i in range(n_layers)], dtype=torch.float64)


def candidate_layers(ctx: SelectionContext) -> list[int]:
    """The layers that may be critical: the global-attention ones (every layer of a model without windows)."""
    glob = [i for i in range(ctx.num_layers) if not ctx.sliding_window(i)]
    return glob or list(range(ctx.num_layers))


def profile_critical_layers(engine, layouts, ratio: float = 0.2, selector: QCFuse | None = None) -> dict:
    """Rank the layers of ``engine``'s model over ``layouts`` (module doc) -> {"ranking": layers best first,
    "recall": mean recall per layer, "per_sample": each sample's recalls, "ratio", "samples"}."""
    rows = [layer_recalls(engine, lay, ratio, selector) for lay in layouts]
    if not rows:
        raise ValueError("profiling needs at least one sample")
    mean = torch.stack(rows).mean(0)
    ranking = sorted((i for i in range(mean.numel()) if not math.isnan(mean[i])),
                     key=lambda i: (-round(float(mean[i]), 12), i))

    def num(x):
        return None if math.isnan(x) else round(float(x), 4)
    return {"ranking": ranking, "recall": [num(x) for x in mean], "per_sample": [[num(x) for x in r] for r in rows],
            "ratio": ratio, "samples": len(rows)}
