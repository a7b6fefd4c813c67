"""The bytes-read bound of a decode step: what sparse decode could gain if a step cost only its reads.

A decode step of B requests reads the model's weights once (every row shares them) and, per row, the K/V
its attention covers. Dense decode covers the whole cache; a sparse policy at most ``k + window`` tokens
per layer and KV head (`SparseDecoder.cap`). Sliding-window layers (Gemma 3 local layers) cover their window
either way. With a step's time proportional to its bytes,

    dense  = W + B * sum_layers min(n, span_l) * t_l
    sparse = W + B * sum_layers min(n, span_l, cap) * t_l

where ``t_l`` is one token's K and V in layer l (``2 x kv_heads x head_dim x element bytes``) and ``W`` the
bytes of the weights (each distinct parameter tensor once: tied embeddings are read once, by the LM head).
``dense / sparse`` is the most a sparse step can speed a dense one up (`bench serve --decode`'s decode vs
dense), ``sparse / dense`` the lowest TPOT ratio it can reach (`bench decode`'s vs full). What the bound
leaves out, listed beside it: the page bounding boxes that selection reads (``box_bytes``), activations,
and a gather's extra copy of the attended K/V.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelBytes:
    """What a decode step's reads depend on: weights, per-layer K/V per token and sliding windows."""

    weight_bytes: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    windows: tuple[int | None, ...]  # per layer: its sliding window (None: full attention)

    @property
    def layer_token_bytes(self) -> int:
        """One token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    def kv_bytes(self, context: int, cap: int | None = None) -> int:
        """K/V one row's step reads over a ``context``-token cache, attending at most ``cap`` tokens a layer."""
        total = 0
        for window in self.windows:
            span = context if window is None else min(context, window)
            total += min(span, cap) if cap is not None else span
        return total * self.layer_token_bytes

    def box_bytes(self, context: int, page_size: int = 32) -> int:
        """The ``(kmax | -kmin)`` float32 boxes a selecting step scores: per page, full layer and KV head."""
        pages = -(-context // page_size)
        layers = sum(1 for w in self.windows if w is None)
        return pages * layers * self.num_kv_heads * 2 * self.head_dim * 4


def model_bytes(engine) -> ModelBytes:
    """`ModelBytes` of a loaded engine (K/V elements of the engine's dtype)."""
    seen, weights = set(), 0
    for p in engine.model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            weights += p.numel() * p.element_size()
    ad = engine.adapter
    return ModelBytes(weights, ad.num_kv_heads, ad.head_dim, engine.dtype.itemsize,
                      tuple(ad.sliding_window(i) for i in range(ad.num_layers)))


def bytes_bound(m: ModelBytes, context: int, batch: float, cap: int, page_size: int = 32) -> dict:
    """The bound of a step of ``batch`` rows of ``context`` cached tokens, sparse rows attending ``cap``
    tokens (k + window): bytes read dense and sparse, ``bound`` = dense / sparse (the speed-up limit) and
    ``bound_tpot`` = sparse / dense (the TPOT-ratio floor); ``box_bytes``: the selection's extra reads."""
    dense = m.weight_bytes + batch * m.kv_bytes(context)
    sparse = m.weight_bytes + batch * m.kv_bytes(context, cap)
    return {"bound_context": context, "bound_batch": batch, "bound_attended": min(context, cap),
            "bound_weight_bytes": m.weight_bytes, "bound_dense_bytes": dense, "bound_sparse_bytes": sparse,
            "bound_box_bytes": batch * m.box_bytes(context, page_size), "bound": dense / sparse,
            "bound_tpot": sparse / dense}
