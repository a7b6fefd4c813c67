"""One sparse attention per layer for every row of a batched decode step (the server's decode passes).

`SparseDecoder.attend` (the per-row reference) spends a few dozen small ops per row and layer; here the
rows of a step share them. Per layer and step:

1. per row, in Python: the static-set bookkeeping (`SparseDecoder._observe`) and the `PagePlan`;
2. page ranking: each row's candidate boxes live in its own `PageBounds`, so the bound is one matmul per
   row, written into a padded ``[B, Hkv, C_max]`` score tensor (``-inf`` past a row's candidates); every
   other step of the policy (signed query, group reduction, top-k) runs once over the batch
   (`DecodePolicy.rank_pages`);
3. one page table ``[B, Hkv, M_max]`` for all rows (front, dynamic, local pages in the reference's order;
   short rows padded with masked pages), then one ``index_select`` per row and K / V from that row's host
   pool (``direct``) or device pool (``pool``: its misses fetched first, as `SparseDecoder._gather` does);
4. one masked GQA attention over ``[B * Hkv, M_max * P]`` keys (two ``bmm`` and a softmax): the mask drops
   pad pages, the unfilled end of the last page and the tokens before a sliding window.

On the CPU with numba, when every row reads its host pool and ranks with a kernel form (`rank_kernel.rank_ok`),
steps 2-4 are one kernel call (`paged_kernel.select_attend_rows`): per (row, KV head) the ranking, the table and the
attention, read in place, split over the intra-op threads.

Every row selects exactly the pages its lone `attend` would (same scores, same top-k order); its output
equals the lone one up to float rounding (the softmax and the value matmul run over the padded length).
Rows this path does not cover run the per-row path (`attend_rows`): other decoder classes (ShadowKV),
working-set layers, and rows whose shapes differ from the first row's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from . import append_kernel, paged_kernel, rank_kernel
from .plan import PagePlan
from .pool import K, V
from .row_threads import row_pool


@dataclass
class _Row:
    """One row of the batched step: its decoder, layer state, query and plan."""

    index: int
    dec: object
    st: object
    q: torch.Tensor
    plan: PagePlan

    @property
    def n_local(self) -> int:
        return self.plan.n_pages - self.plan.local_start

    @property
    def n_pages(self) -> int:  # pages the row attends: front + dynamic + local
        return self.plan.front + self.plan.n_dynamic + self.n_local

    @property
    def scored(self) -> bool:  # the row ranks its candidates (else it takes none or all of them)
        return 0 < self.plan.n_dynamic < self.plan.n_candidates


def batchable(dec, layer: int, like=None) -> bool:
    """Whether ``dec``'s attend at ``layer`` can join a batched step (with the row ``like``, if given)."""
    from .decoder import SparseDecoder

    if type(dec) is not SparseDecoder or dec.layers[layer] is None or dec.layers[layer].ws is not None:
        return False
    if like is None:
        return True
    return ((dec.num_q_heads, dec.num_kv_heads, dec.head_dim, dec.page_size, dec.dtype, dec.device)
            == (like.num_q_heads, like.num_kv_heads, like.head_dim, like.page_size, like.dtype, like.device))


def attend_batch(decoders: list, layer: int, queries: list[torch.Tensor], scaling: float) -> list[torch.Tensor]:
    """``decoders[i].attend(layer, queries[i], scaling)`` for every row of one batched decode step
    (``queries[i] [Hq, 1, D]`` -> ``[Hq, 1, D]``), the rows sharing their ops (module docstring)."""
    from .decoder import attend_rows

    first = next((d for d in decoders if batchable(d, layer)), None)
    mine = [i for i, d in enumerate(decoders) if first is not None and batchable(d, layer, first)]
    out: list[torch.Tensor | None] = [None] * len(decoders)
    if mine:
        for i, o in zip(mine, _attend_rows_batched([decoders[i] for i in mine], layer,
                                                   [queries[i] for i in mine], scaling)):
            out[i] = o
    rest = [i for i in range(len(decoders)) if out[i] is None]
    if rest:
        for i, o in zip(rest, attend_rows([decoders[i] for i in rest], layer, [queries[i] for i in rest], scaling)):
            out[i] = o
    return out


def append_batch(decoders: list, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``decoders[i].append(layer, keys[i], values[i])`` for every row of one batched decode step (``keys [B,
    Hkv, 1, D]``): on the CPU with numba, the rows appending to a float32 host pool (no working set, no device
    pool) in one kernel call (`append_kernel.append_rows`), a row's few small torch ops otherwise."""
    fast = [i for i, d in enumerate(decoders) if _appends_in_place(d, layer, keys.dtype)]
    if len(fast) > 1:
        sts = [decoders[i]._layer(layer) for i in fast]
        index = torch.tensor(fast)
        append_kernel.append_rows(keys.index_select(0, index)[:, :, 0], values.index_select(0, index)[:, :, 0],
                                 [st.host for st in sts], [st.bounds for st in sts])
    else:
        fast = []
    for i in sorted(set(range(len(decoders))) - set(fast)):
        decoders[i].append(layer, keys[i], values[i])


def _appends_in_place(dec, layer: int, dtype) -> bool:
    from .decoder import SparseDecoder

    st = dec.layers[layer] if type(dec) is SparseDecoder and layer < len(dec.layers) else None
    return (st is not None and dec.direct and st.ws is None and st.device is None and dtype == torch.float32
            and paged_kernel.kernel_ok(st.host.dtype, dec.device))


def _plan_rows(decoders: list, layer: int, queries: list[torch.Tensor], scaling: float) -> list[_Row]:
    rows = []
    for i, (dec, q) in enumerate(zip(decoders, queries)):
        st, plan = dec.begin_step(layer, q, scaling)
        rows.append(_Row(i, dec, st, q, plan))
    return rows


def _attend_rows_batched(decoders: list, layer: int, queries: list[torch.Tensor],
                         scaling: float) -> list[torch.Tensor]:
    d0 = decoders[0]
    H, D, P, dev = d0.num_kv_heads, d0.head_dim, d0.page_size, d0.device
    rows = _plan_rows(decoders, layer, queries, scaling)
    q = torch.stack([r.q for r in rows]).to(dev)  # [B, Hq, 1, D]
    B, Hq = q.shape[0], q.shape[1]
    mask = None
    fused = _select_attend_in_place(rows, q.view(B, Hq, D), scaling) if paged_kernel.kernel_ok(d0.dtype, dev) else None
    if fused is not None:  # CPU, host pools: tables, ranking and attention in one kernel call
        pages, out = fused
        out = out.view(B, Hq, 1, D).to(q.dtype)
    elif paged_kernel.kernel_ok(d0.dtype, dev):  # CPU only: float32 pools read in place, no gather copy
        pages = _page_table(rows, q.view(B, H, Hq // H, D), dev)  # [B, H, M]
        out = _attend_in_place(rows, pages, q.view(B, Hq, D), scaling).view(B, Hq, 1, D).to(q.dtype)
    else:  # the reference path (CUDA, half-precision pools, no numba)
        pages = _page_table(rows, q.view(B, H, Hq // H, D), dev)
        keys, values = _gather(rows, pages, H, pages.shape[2], P, D, d0.dtype, dev)
        mask = _mask(rows, pages, P)
        out = _masked_attention(q, keys, values, mask[1], scaling)
    table = pages.cpu()
    for r, o in zip(rows, out):
        dec, m = r.dec, r.n_pages
        r.st.selected = table[r.index, :, :m]
        dec._pages_read += H * m
        dec._count(r.plan)
        if dec.diagnostic:
            if mask is None:
                mask = _mask(rows, pages, P)
            tokens, valid = mask
            valid_r = valid[r.index * H:(r.index + 1) * H, 0, : m * P]
            dec._record_recall(layer, r.st, r.plan, r.q, scaling, o, tokens[r.index, :, :m].flatten(1), valid_r)
    return list(out)


def _select_attend_in_place(rows: list[_Row], q: torch.Tensor, scaling: float):
    """CPU, every row reading its host pool: `paged_kernel.select_attend_rows` (each row's page table, its ranking
    or remembered pages, and the attention, in one call) -> (page tables ``[B, Hkv, M]``, ``[B, Hq, D]`` float32),
    or None when a row's ranking has no kernel form (e.g. ArkVale's shared groups) or a row reads a device pool."""
    if any(not r.dec.direct for r in rows):
        return None
    reused = []
    for r in rows:
        kept = r.dec.reused_pages(r.st, r.plan) if r.scored else None
        if r.scored and kept is None and not rank_kernel.rank_ok(r.dec.policy, "cpu"):
            return None
        reused.append(kept)
    table, dynamic, out, ranked = paged_kernel.select_attend_rows(
        q, [r.st.host.data for r in rows], [r.st.bounds for r in rows], [r.plan for r in rows],
        [r.dec.policy for r in rows], reused, scaling)
    for r, now in zip(rows, ranked):
        if now:
            r.dec.remember_ranking(r.st, r.plan, dynamic[r.index, :, : r.plan.n_dynamic])
    return table, out


def _mask(rows: list[_Row], pages: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage index of every table entry's tokens ``[B, Hkv, M, P]`` and which are attended
    ``[B * Hkv, 1, M * P]``: not a pad page, not the unfilled end of the last page, not before a sliding window."""
    (B, H, M), dev = pages.shape, pages.device
    tokens = pages.unsqueeze(-1) * P + torch.arange(P, device=dev)
    ints = torch.tensor([[r.n_pages, r.plan.n_tokens, r.plan.lo] for r in rows], device=dev).view(B, 3, 1, 1, 1)
    valid = ((torch.arange(M, device=dev).view(1, 1, M, 1) < ints[:, 0]) & (tokens < ints[:, 1])
             & (tokens >= ints[:, 2])).view(B * H, 1, M * P)
    return tokens, valid


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """GQA attention of ``q [B, Hq, 1, D]`` over the gathered ``keys / values [B * Hkv, T, D]`` (float32)."""
    B, Hq, _, D = q.shape
    f32 = torch.float32
    qf = q.view(keys.shape[0], -1, D)
    logits = torch.bmm(qf if qf.dtype == f32 else qf.float(),
                       (keys if keys.dtype == f32 else keys.float()).transpose(1, 2)).mul_(scaling)
    logits.masked_fill_(~valid, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.bmm(probs, values if values.dtype == f32 else values.float()).view(B, Hq, 1, D).to(q.dtype)


def _attend_in_place(rows: list[_Row], pages: torch.Tensor, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """CPU only: `paged_kernel.paged_attention` over each row's pool (the host pool, or for the pool tier the
    device pool after its misses are fetched) -> ``[B, Hq, D]`` float32."""
    H, M = pages.shape[1:]
    pools, slots = [], pages
    table = pages.cpu() if any(not r.dec.direct for r in rows) else None
    for r in rows:
        if r.dec.direct:
            pools.append(r.st.host.data)
            continue
        if slots is pages:
            slots = pages.clone()
        slots[r.index] = _fetch(r, table, H, M)
        pools.append(r.st.device.data)
    ints = torch.tensor([[r.n_pages, r.plan.n_tokens, r.plan.lo] for r in rows])
    return paged_kernel.paged_attention(q, pools, slots, pages, ints[:, 0], ints[:, 1], ints[:, 2], scaling)


def _page_table(rows: list[_Row], q: torch.Tensor, dev) -> torch.Tensor:
    """Pages ``[B, Hkv, M_max]`` of every row, in the per-row order (front, dynamic by rank, local); pad
    entries repeat page 0 (masked by the caller)."""
    B, H = q.shape[:2]
    M = max(r.n_pages for r in rows)
    n_dyn = max(r.plan.n_dynamic for r in rows)
    dyn = torch.arange(max(1, n_dyn), device=dev).expand(B, H, -1).clone()  # relative to the row's front
    scored = [r for r in rows if r.scored]
    if scored:  # rows of one policy (equal settings) rank together
        groups: dict[int, list[_Row]] = {}
        for r in scored:
            key = next((k for k, g in groups.items() if g[0].dec.policy == r.dec.policy), id(r))
            groups.setdefault(key, []).append(r)
        for g in groups.values():
            ranked = []
            for r in g:  # rows whose last ranking still serves (the policy's rerank_interval) reuse it
                kept = r.dec.reused_pages(r.st, r.plan)
                if kept is None:
                    ranked.append(r)
                else:
                    dyn[r.index, :, : r.plan.n_dynamic] = kept.to(dev) - r.plan.front
            if not ranked:
                continue
            if rank_kernel.rank_ok(g[0].dec.policy, dev):  # CPU: each row's scores and top-k in one numba call
                for r in ranked:
                    pages = rank_kernel.top_pages(r.dec.policy, q[r.index], r.st.bounds, r.plan.front,
                                                   r.plan.local_start, r.plan.n_dynamic, r.dec.scaling)
                    dyn[r.index, :, : r.plan.n_dynamic] = pages - r.plan.front
                    r.dec.remember_ranking(r.st, r.plan, pages)
                continue
            idx = torch.tensor([r.index for r in ranked], device=dev)
            boxes = [r.st.bounds.digests(r.plan.front, r.plan.local_start) for r in ranked]
            scores = g[0].dec.policy.rank_pages(q.index_select(0, idx), boxes, [r.plan.front for r in ranked],
                                                g[0].dec.scaling)
            k = max(r.plan.n_dynamic for r in ranked)
            dyn[idx, :, :k] = scores.topk(k, dim=-1).indices
            for r in ranked:
                r.dec.remember_ranking(r.st, r.plan, dyn[r.index, :, : r.plan.n_dynamic] + r.plan.front)  # a copy
    ints = torch.tensor([[r.plan.front, r.plan.front + r.plan.n_dynamic, r.n_pages, r.plan.local_start]
                         for r in rows], device=dev).view(B, 4, 1, 1)
    front, end_dyn, n_pages, local = ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3]
    j = torch.arange(M, device=dev).view(1, 1, M)
    dynamic = front + dyn.gather(2, (j - front).clamp(0, dyn.shape[2] - 1).expand(B, H, M))
    table = torch.where(j < end_dyn, dynamic, local + (j - end_dyn))
    table = torch.where(j < front, j, table)
    return torch.where(j < n_pages, table, 0)


_BUFFERS = threading.local()  # per thread (a server worker, a bench): its gather buffer, reused


def _buffer(numel: int, dtype, dev) -> torch.Tensor:
    """A reused flat buffer of at least ``numel`` elements: a fresh multi-MB tensor per layer and step would be
    an mmap and its page faults each time (CPU), costing more than the gather itself."""
    buf = getattr(_BUFFERS, "buf", None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(dev):
        buf = _BUFFERS.buf = torch.empty(numel, dtype=dtype, device=dev)
    return buf[:numel]


def _gather(rows: list[_Row], pages: torch.Tensor, H: int, M: int, P: int, D: int, dtype, dev):
    """K and V ``[B * Hkv, M * P, D]`` of every row's page table: one ``index_select`` per row and kind,
    from the host pool (``direct``) or, after fetching the misses, the device pool (``pool``)."""
    B = len(rows)
    buf = _buffer(2 * B * H * M * P * D, dtype, dev).view(2, B, H * M, P, D)
    keys, values = buf[0], buf[1]
    heads = torch.arange(H, device=dev).view(1, H, 1)
    index = (pages * H + heads).view(B, H * M)
    table = pages.cpu() if any(not r.dec.direct for r in rows) else None

    def copy(row: _Row) -> None:
        dec, st = row.dec, row.st
        if dec.direct:
            src_k, src_v, idx = st.host.flat(K), st.host.flat(V), index[row.index]
        else:
            idx = (_fetch(row, table, H, M).to(dev) * H + heads[0]).flatten()
            src_k, src_v = (st.device.data[:, :, kind].flatten(0, 1) for kind in (K, V))
        torch.index_select(src_k, 0, idx, out=keys[row.index])
        torch.index_select(src_v, 0, idx, out=values[row.index])

    _each_row(rows, copy, dev)
    return keys.view(B * H, M * P, D), values.view(B * H, M * P, D)


def _fetch(row: _Row, table: torch.Tensor, H: int, M: int) -> torch.Tensor:
    """The pool tier: the row's distinct pages made resident (one batched transfer of the misses) -> their
    device-pool slots ``[Hkv, M]`` (CPU; pad entries repeat the first slot)."""
    dec, st = row.dec, row.st
    dec._clock += 1
    slots = st.device.fetch(table[row.index, :, : row.n_pages], st.host, dec.transfer, dec._clock)
    return torch.cat([slots, slots[:, :1].expand(H, M - row.n_pages)], dim=1)


def _each_row(rows: list[_Row], fn, dev) -> None:
    """``fn(row)`` for every row; on a CPU with several intra-op threads the rows are split over that many
    threads, each single-threaded (one row's copy is too small to split well; the rows write disjoint
    slices of the buffers), as `decoder.attend_rows` splits whole rows."""
    threads = torch.get_num_threads()
    if len(rows) < 2 or threads < 2 or torch.device(dev).type != "cpu":
        for r in rows:
            fn(r)
        return
    workers = min(threads, len(rows))

    def run(share):
        for r in share:
            fn(r)

    torch.set_num_threads(1)
    try:
        futures = [row_pool(workers - 1).submit(run, rows[w::workers]) for w in range(1, workers)]
        run(rows[::workers])
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(threads)
