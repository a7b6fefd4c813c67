"""CPU only: sparse GQA attention that reads the selected pages in place from the paged pools (numba JIT).

The torch path of `decode.batched` copies every selected (page, head) block into a gather buffer and then
runs two ``bmm`` over the copy, so the selected K/V cross memory three times. This kernel walks each row's
page table and reads K and V straight from the row's pool (``[pages, Hkv, 2, P, D]``, HND: one head's
page is one contiguous block), with an online softmax (running max and sum per query head, float32), so
they cross once. Per (row, KV head) pair: the ``G`` query heads of the group read each page's keys while
the page is in L1, then its values; the next page's K and V are prefetched meanwhile (a page is a few KB
at a random address). The pairs are split over torch's intra-op thread count by Python threads
(the kernel releases the GIL) rather than numba's ``prange``: numba's OpenMP pool and torch's spin-wait
against each other on a loaded CPU (measured 3-10x slower at 1-2 threads, torch's own matmuls included),
and its workqueue pool aborts when two threads (server workers) call in at once. A lone decoder's step
(`SparseDecoder.attend`, batch 1, the host pool read directly) builds its page table, ranks its pages and
attends in one call (`select_attend_row`), in place of a gather and two ``bmm`` and of the half-dozen small
torch ops a layer that building the table separately costs.

Where the time goes (SmolLM2, 8 rows x 7.7K, 1,088 tokens a row, 2 threads): reading the selected blocks
alone (a loop that only sums them) takes ~1.5 ms a layer, this kernel ~1.7 ms on its own. Inside a decode
step the second share needs the core where torch's OpenMP workers spin after the projections: with libgomp's
default spin (``GOMP_SPINCOUNT`` 300,000) the kernel ran no faster on two threads than on one (~3 ms a layer);
`kvstitch` shortens the spin at import (``kvstitch/__init__.py``), ~1.8 ms.

Only float32 pools on the CPU take it (`kernel_ok`): numba has no bfloat16 type, so a half-precision pool
would need a per-element upcast it cannot express; those pools, CUDA pools and installs without numba
(the ``kvstitch[fast]`` extra) run the torch path, which is the reference the kernel is tested against.

The page ranking lives in `rank_kernel` (a lone step's one call uses it), the batched appends in
`append_kernel`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvstitch.core.errors import InputError

from . import kernel_common
from .kernel_common import available, int64_array, numba, split_pairs  # noqa: F401 - available: the kernels' probe
from .rank_kernel import REDUCES


def kernel_ok(dtype: torch.dtype, device) -> bool:
    """Whether the batched decode path reads pools of ``dtype`` on ``device`` with the kernel: float32 on the
    CPU, numba present and `kernel_common.ENABLED`."""
    return dtype == torch.float32 and kernel_common.usable(device)


if numba is not None:
    # numba-only names: without the `fast` extra this module still imports and `kernel_ok` says no
    from .kernel_common import f32_pointer, prefetch
    from .rank_kernel import rank_head

    @numba.njit(nogil=True, cache=True)
    def _prefetch_block(pool, slot, h):
        """Prefetch the K and V of pool block ``(slot, h)`` (one contiguous ``2 * P * D`` run): a selected page
        is a few KB at a random address, too short for the hardware prefetcher to ramp up on."""
        block = pool[slot, h]
        start = np.int64(block.ctypes.data)
        for off in range(0, block.size * block.itemsize, 64):
            prefetch(start + off)


    @numba.njit(nogil=True, cache=True)
    def _slots_inside(slots, counts, capacity):
        """Whether every attended entry ``j < counts[b] <= M`` of ``slots [B, Hkv, M]`` lies in row b's pool."""
        for b in range(slots.shape[0]):
            if counts[b] > slots.shape[2]:
                return False
            for h in range(slots.shape[1]):
                for j in range(counts[b]):
                    if slots[b, h, j] < 0 or slots[b, h, j] >= capacity[b]:
                        return False
        return True

    @numba.njit(nogil=True, fastmath=False, cache=True)
    def _paged_attention(q, addresses, capacity, P, slots, pages, counts, n_tokens, lo, scaling, out, share, shares):
        """The (row, KV head) pairs ``share, share + shares, ...`` of the batch (one thread's share)."""
        B, H, _ = slots.shape
        G = q.shape[1] // H
        for bh in range(share, B * H, shares):
            b, h = bh // H, bh % H
            pool = numba.carray(f32_pointer(addresses[b]), (capacity[b], H, 2, P, q.shape[2]))
            _attend_pair(q[b], h * G, G, pool, h, slots[b, h], pages[b, h], counts[b], n_tokens[b], lo[b],
                         np.float32(scaling), out[b])

    @numba.njit(nogil=True, fastmath=False, cache=True)
    def _attend_pair(q, q0, G, pool, h, slots, pages, count, n_tokens, lo, scaling, out):
        """One (row, KV head): query heads ``q[q0 : q0 + G]`` over the row's ``count`` pages -> the same rows
        of ``out``. Inner loops index 1-d contiguous views (``acc[g]``, ``values[t]``) from 0: LLVM vectorizes
        those, not 2-d subscripts or indices it cannot prove non-negative (numba's wraparound)."""
        D = q.shape[1]
        P = pool.shape[3]
        run_max = np.full(G, -np.inf, dtype=np.float32)
        run_sum = np.zeros(G, dtype=np.float32)
        acc = np.zeros((G, D), dtype=np.float32)
        logits = np.empty((G, P), dtype=np.float32)
        probs = np.empty((G, P), dtype=np.float32)
        bits = np.empty(P, dtype=np.int32)
        if count > 0:
            _prefetch_block(pool, slots[0], h)
        for j in range(count):
            if j + 1 < count:  # the next page loads while this one is computed
                _prefetch_block(pool, slots[j + 1], h)
            first = pages[j] * P  # storage index of the page's first token (masks use it; reads use the slot)
            a, e = max(0, lo - first), min(P, n_tokens - first)
            if e <= a:
                continue
            n = e - a  # loops run over range(n) on views from 0: provably non-negative indices vectorize
            _page_logits(q, q0, pool[slots[j], h, 0, a:e], scaling, logits)
            for g in range(G):
                acc_g, logits_g, probs_g = acc[g], logits[g], probs[g]
                new_max = run_max[g]
                for t in range(n):
                    new_max = max(new_max, logits_g[t])
                rescale = np.float32(math.exp(run_max[g] - new_max))  # 0 on the first page (-inf)
                for d in range(D):
                    acc_g[d] *= rescale
                _exp_shifted(logits_g, new_max, n, probs_g, bits)
                page_sum = np.float32(0.0)
                for t in range(n):
                    page_sum += probs_g[t]
                run_sum[g] = run_sum[g] * rescale + page_sum
                run_max[g] = new_max
            _accumulate_values(probs, pool[slots[j], h, 1, a:e], acc)
        for g in range(G):
            inv = np.float32(1.0) / run_sum[g] if run_sum[g] > 0 else np.float32(0.0)  # no token: zeros
            acc_g, out_g = acc[g], out[q0 + g]
            for d in range(D):
                out_g[d] = acc_g[d] * inv

    @numba.njit(nogil=True, fastmath={"contract"}, cache=True)  # fused multiply-adds
    def _accumulate_values(probs, values, acc):
        """``acc[g] += probs[g, t] * values[t]`` over a page's ``len(values)`` tokens. Each value row is read once
        for all ``G`` heads of the group, and four tokens go into each pass over an accumulator row: the
        accumulator's loads and stores, not the multiplies, bound this loop (the whole kernel measured 1.07x / 1.13x
        faster than with a one-token, one-head loop at G = 3 / 7)."""
        n, D = values.shape
        n4 = n - n % 4
        for t in range(0, n4, 4):
            v0, v1, v2, v3 = values[t], values[t + 1], values[t + 2], values[t + 3]
            for g in range(acc.shape[0]):
                p0, p1, p2, p3 = probs[g, t], probs[g, t + 1], probs[g, t + 2], probs[g, t + 3]
                acc_g = acc[g]
                for d in range(D):
                    acc_g[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d])
        for t in range(n4, n):
            v = values[t]
            for g in range(acc.shape[0]):
                p = probs[g, t]
                acc_g = acc[g]
                for d in range(D):
                    acc_g[d] += p * v[d]

    @numba.njit(nogil=True, fastmath={"contract"}, cache=True)  # fused multiply-adds
    def _exp_shifted(x, shift, n, out, bits):
        """``out[t] = exp(x[t] - shift)`` for ``t < n`` (all <= 0): Cephes' expf (2^k times a degree-7
        polynomial on [-ln2/2, ln2/2], ~2 ulp) in loops LLVM vectorizes; libm's exp is one call per element
        (~9 ns: about half of the kernel's time before). ``bits`` is scratch for 2^k."""
        for t in range(n):
            v = max(x[t] - shift, np.float32(-87.0))  # exp(-87) ~ 1.6e-38: still a normal float32
            k = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
            r = v - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)  # v - k ln2 in two parts
            poly = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
            poly = poly * r + np.float32(8.3334519073e-3)
            poly = poly * r + np.float32(4.1665795894e-2)
            poly = poly * r + np.float32(1.6666665459e-1)
            poly = poly * r + np.float32(5.0000001201e-1)
            out[t] = poly * r * r + r + np.float32(1.0)
            bits[t] = (np.int32(k) + np.int32(127)) << np.int32(23)
        scale = bits.view(np.float32)
        for t in range(n):
            out[t] *= scale[t]

    # Reassociation lets LLVM vectorize the dot products' reduction (a scalar chain measured ~15x slower at
    # D = 64); only here, and without fastmath's no-inf / no-nan flags (the softmax relies on -inf).
    @numba.njit(nogil=True, fastmath={"reassoc", "contract"}, cache=True)
    def _page_logits(q, q0, keys, scaling, logits):
        """``logits[g, t] = scaling * q[q0 + g] . keys[t]`` for the ``t < len(keys)`` attended tokens of a page."""
        for g in range(logits.shape[0]):
            qg, logits_g = q[q0 + g], logits[g]
            for t in range(keys.shape[0]):
                k = keys[t]
                s = np.float32(0.0)
                for d in range(qg.shape[0]):
                    s += qg[d] * k[d]
                logits_g[t] = s * scaling

    @numba.njit(nogil=True, fastmath=False, cache=True)
    def _head_table(q, q0, G, digests, front, local_start, n_pages, n_dynamic, use_reused, reused, moments, reduce,
                    scale, dynamic, row):
        """One KV head's page table into ``row``: front pages, the dynamic ones best first, local pages (every page
        when all candidates fit). The dynamic pages are ``reused`` (an earlier ranking still serving) or ranked
        here from the head's ``digests [pages, 2D]`` for the query heads ``q[q0 : q0 + G]`` (`rank_head`); they
        are written to ``dynamic``. -> the table's length."""
        if n_dynamic == local_start - front:
            for j in range(n_pages):
                row[j] = j
            return n_pages
        for j in range(front):
            row[j] = j
        if n_dynamic > 0:
            if use_reused:
                for j in range(n_dynamic):
                    dynamic[j] = reused[j]
            else:
                rank_head(q, q0, G, digests, front, local_start - front, n_dynamic, moments, reduce, scale, dynamic)
                for j in range(n_dynamic):
                    dynamic[j] += front
            for j in range(n_dynamic):
                row[front + j] = dynamic[j]
        for j in range(n_pages - local_start):
            row[front + n_dynamic + j] = local_start + j
        return front + n_dynamic + n_pages - local_start

    @numba.njit(nogil=True, fastmath=False, cache=True)
    def _select_attend(q, pool, digests, front, local_start, n_pages, n_dynamic, use_reused, reused, moments, reduce,
                       n_tokens, lo, scaling, table, dynamic, out):
        """A lone decode step's layer in one call: per KV head its page table (`_head_table`: ``reused [Hkv,
        n_dynamic]`` if ``use_reused``, else ranked from ``digests [Hkv, pages, 2D]``) into ``table [Hkv, M]``,
        then attention of ``q [Hq, D]`` over it, read in place from ``pool [capacity, Hkv, 2, P, D]``, into
        ``out [Hq, D]``. Every page lies below ``n_pages``, inside the pool."""
        H, M = table.shape
        G = q.shape[0] // H
        for h in range(H):
            row = table[h]
            m = _head_table(q, h * G, G, digests[h], front, local_start, n_pages, n_dynamic, use_reused, reused[h],
                            moments, reduce, scaling, dynamic[h], row)
            _attend_pair(q, h * G, G, pool, h, row, row, m, n_tokens, lo, np.float32(scaling), out)

    @numba.njit(nogil=True, fastmath=False, cache=True)
    def _select_attend_batch(q, addresses, capacity, P, digest_addresses, digest_capacity, ints, reused, scales,
                             table, dynamic, out, share, shares):
        """`_select_attend` for the (row, KV head) pairs ``share, share + shares, ...`` of a batch: row ``b``'s
        pool and digests at ``addresses[b]`` / ``digest_addresses[b]``; ``ints [B, 9]``: front, local start,
        pages, dynamic pages, tokens, first token attended, whether ``reused[b]`` serves, digest kind, group
        rule. ``table [B, Hkv, M]`` gets each row's pages, then repeats of page 0 (pad)."""
        B, H, M = table.shape
        D = q.shape[2]
        G = q.shape[1] // H
        for bh in range(share, B * H, shares):
            b, h = bh // H, bh % H
            front, local_start, n_pages, n_dynamic, n_tokens, lo = (ints[b, 0], ints[b, 1], ints[b, 2], ints[b, 3],
                                                                    ints[b, 4], ints[b, 5])
            pool = numba.carray(f32_pointer(addresses[b]), (capacity[b], H, 2, P, D))
            digests = numba.carray(f32_pointer(digest_addresses[b]), (H, digest_capacity[b], 2 * D))
            row = table[b, h]
            m = _head_table(q[b], h * G, G, digests[h], front, local_start, n_pages, n_dynamic, ints[b, 6] != 0,
                            reused[b, h], ints[b, 7] != 0, ints[b, 8], scales[b], dynamic[b, h], row)
            for j in range(m, M):
                row[j] = 0
            _attend_pair(q[b], h * G, G, pool, h, row, row, m, n_tokens, lo, np.float32(scales[b]), out[b])



def paged_attention(q: torch.Tensor, pools: list[torch.Tensor], slots: torch.Tensor, pages: torch.Tensor,
                    counts: torch.Tensor, n_tokens: torch.Tensor, lo: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """CPU only (float32 pools, numba). GQA attention of ``q [B, Hq, D]`` over row ``b``'s pages, read in place.

    ``pools[b]``: row b's pool ``[capacity, Hkv, 2, P, D]`` (contiguous; K at index 0 of axis 2, V at 1);
    ``slots / pages [B, Hkv, M]``: entry ``j < counts[b]`` reads pool block ``slots[b, h, j]`` holding storage
    page ``pages[b, h, j]`` (equal for the host pool; a device pool's slot otherwise); tokens outside
    ``[lo[b], n_tokens[b])`` (by storage index) are masked. A row with no token left gets zeros.
    Returns ``[B, Hq, D]`` float32.
    """
    B, Hq, D = q.shape
    H, P = pools[0].shape[1], pools[0].shape[3]
    if len(pools) != B or slots.shape != pages.shape or slots.shape[:2] != (B, H) or Hq % H:
        raise InputError(f"paged_attention: q {tuple(q.shape)}, {len(pools)} pools, slots {tuple(slots.shape)}, "
                         f"pages {tuple(pages.shape)} do not describe one batch of {H} KV heads")
    for pool in pools:
        if pool.dtype != torch.float32 or pool.device.type != "cpu" or not pool.is_contiguous():
            raise InputError("paged_attention reads contiguous float32 CPU pools only")
        if pool.shape[1:] != (H, 2, P, D):
            raise InputError(f"pool shape {tuple(pool.shape)} does not match [*, {H}, 2, {P}, {D}]")
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    _run(q.float().contiguous().numpy(), np.array([p.data_ptr() for p in pools], dtype=np.int64),
         np.array([p.shape[0] for p in pools], dtype=np.int64), P, int64_array(slots), int64_array(pages), int64_array(counts),
         int64_array(n_tokens), int64_array(lo), float(scaling), out.numpy())
    return out


def attend_row(q: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, n_tokens: int, lo: int,
               scaling: float) -> torch.Tensor:
    """CPU only (float32, numba). One decoder's attention (`SparseDecoder`, batch 1) read in place from its
    host pool: ``q [Hq, 1, D]`` over ``pages [Hkv, M]`` (CPU int64; every entry attended, tokens outside
    ``[lo, n_tokens)`` masked) -> ``[Hq, 1, D]`` float32. `paged_attention` for one row without its per-call
    tensors (a lone step's attention is ~0.3 ms a layer, where a few dozen microseconds of wrapper show), on
    the calling thread only: waking a pool thread for a second share every layer cost what the share saved
    (SmolLM2 7.7K, 2 threads: PRKV 0.83 of dense decode's step with a second share, 0.82 without, the torch
    gather path 0.83 / 0.86 in the same runs)."""
    Hq, _, D = q.shape
    H, M = pages.shape
    if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.shape[1:] != (H, 2, pool.shape[3], D):
        raise InputError(f"attend_row: pool {tuple(pool.shape)} {pool.dtype} does not hold {H} KV heads of {D}")
    table = pages.to(torch.int64).contiguous().numpy().reshape(1, H, M)
    out = np.empty((1, Hq, D), dtype=np.float32)
    _run(q.float().reshape(1, Hq, D).contiguous().numpy(), np.array([pool.data_ptr()], dtype=np.int64),
         np.array([pool.shape[0]], dtype=np.int64), pool.shape[3], table, table, np.array([M], dtype=np.int64),
         np.array([n_tokens], dtype=np.int64), np.array([lo], dtype=np.int64), float(scaling), out, workers=1)
    return torch.from_numpy(out).view(Hq, 1, D)


def select_attend_row(q: torch.Tensor, pool: torch.Tensor, bounds, plan, policy, reused: torch.Tensor | None,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """CPU only (float32, numba). One lone decode step's layer (`SparseDecoder`, batch 1) in one call: its page
    table from the step's `PagePlan` ``plan`` (front pages, the dynamic ones, local pages), ranking the dynamic
    pages as `top_pages` does unless ``reused`` (an earlier ranking, ``[Hkv, n_dynamic]``) still serves, then
    `attend_row` over it. The half-dozen torch ops a layer of the separate calls (range tables, a concatenation,
    per-call tensors) cost as much as the ranking itself. -> (page table ``[Hkv, M]``, the pages ranked now
    ``[Hkv, n_dynamic]`` or None, the attention ``[Hq, 1, D]`` float32)."""
    Hq, _, D = q.shape
    H = pool.shape[1]
    if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.shape[1:] != (H, 2, plan.page_size, D):
        raise InputError(f"select_attend_row: pool {tuple(pool.shape)} {pool.dtype} does not hold {H} KV heads of "
                         f"{D} in pages of {plan.page_size}")
    front, local, n_dyn, n_pages = plan.front, plan.local_start, plan.n_dynamic, plan.n_pages
    if n_pages > pool.shape[0]:
        raise InputError(f"select_attend_row: {n_pages} pages planned, the pool holds {pool.shape[0]}")
    every = n_dyn == local - front
    rank = not every and n_dyn > 0 and reused is None
    if rank:
        bounds.settle(front, local)
    table = np.empty((H, n_pages if every else front + n_dyn + n_pages - local), dtype=np.int64)
    dynamic = np.empty((H, n_dyn), dtype=np.int64)
    out = np.empty((Hq, D), dtype=np.float32)
    q2d = q.reshape(Hq, D)
    if q2d.dtype != torch.float32 or not q2d.is_contiguous():
        q2d = q2d.float().contiguous()
    _select_attend(q2d.numpy(), pool.numpy(), bounds.data.numpy(), front, local, n_pages, n_dyn, reused is not None,
                   dynamic if reused is None else reused.numpy(), getattr(policy, "digest", "box") == "moments",
                   REDUCES[getattr(policy, "group_reduce", "max")], plan.n_tokens, plan.lo, float(scaling), table,
                   dynamic, out)
    return torch.from_numpy(table), torch.from_numpy(dynamic) if rank else None, torch.from_numpy(out).view(Hq, 1, D)


def select_attend_rows(q: torch.Tensor, pools: list[torch.Tensor], bounds: list, plans: list, policies: list,
                       reused: list, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]]:
    """CPU only (float32 host pools, numba). `select_attend_row` for every row of a batched decode step: row
    ``b``'s page table from ``plans[b]``, its dynamic pages ``reused[b]`` or ranked from ``bounds[b]`` by
    ``policies[b]``, and its attention ``q[b] [Hq, D]`` over its pool ``pools[b] [capacity, Hkv, 2, P, D]``;
    the (row, KV head) pairs split over torch's intra-op thread count as in `paged_attention`. -> (page tables
    ``[B, Hkv, M]``, row b's first entries its own and the rest page 0; the dynamic pages ``[B, Hkv, *]``,
    absolute; the attention ``[B, Hq, D]`` float32; whether each row ranked now)."""
    B, Hq, D = q.shape
    H, P = pools[0].shape[1], pools[0].shape[3]
    if not len(pools) == len(bounds) == len(plans) == len(policies) == len(reused) == B or Hq % H:
        raise InputError(f"select_attend_rows: q {tuple(q.shape)} and {len(pools)} pools, {len(bounds)} digests, "
                         f"{len(plans)} plans do not describe one batch of {H} KV heads")
    ints = np.empty((B, 9), dtype=np.int64)
    n_dyn = max(1, max(p.n_dynamic for p in plans))
    kept = np.zeros((B, H, n_dyn), dtype=np.int64)
    ranks, M = [], 1
    for b, (pool, digest, plan, policy, pages) in enumerate(zip(pools, bounds, plans, policies, reused)):
        if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.shape[1:] != (H, 2, P, D):
            raise InputError(f"select_attend_rows: pool {tuple(pool.shape)} {pool.dtype} is not a contiguous "
                             f"float32 pool of [*, {H}, 2, {P}, {D}]")
        if plan.n_pages > pool.shape[0] or plan.page_size != P:
            raise InputError(f"select_attend_rows: row {b} plans {plan.n_pages} pages of {plan.page_size}, its pool "
                             f"holds {pool.shape[0]} of {P}")
        front, local = plan.front, plan.local_start
        every = plan.n_dynamic == local - front
        rank = not every and plan.n_dynamic > 0 and pages is None
        if rank:
            digest.settle(front, local)
        if pages is not None:
            kept[b, :, :plan.n_dynamic] = pages.numpy()
        ranks.append(rank)
        M = max(M, plan.n_pages if every else front + plan.n_dynamic + plan.n_pages - local)
        ints[b] = (front, local, plan.n_pages, plan.n_dynamic, plan.n_tokens, plan.lo, pages is not None,
                   getattr(policy, "digest", "box") == "moments", REDUCES[getattr(policy, "group_reduce", "max")])
    data = [d.data for d in bounds]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape[0] != H or t.shape[2] != 2 * D for t in data):
        raise InputError(f"select_attend_rows: page digests must be contiguous float32 [{H}, *, {2 * D}]")
    table = np.empty((B, H, M), dtype=np.int64)
    dynamic = np.empty((B, H, n_dyn), dtype=np.int64)
    out = np.empty((B, Hq, D), dtype=np.float32)
    args = (q.float().contiguous().numpy(), np.array([p.data_ptr() for p in pools], dtype=np.int64),
            np.array([p.shape[0] for p in pools], dtype=np.int64), P,
            np.array([t.data_ptr() for t in data], dtype=np.int64), np.array([t.shape[1] for t in data], dtype=np.int64),
            ints, kept, np.full(B, float(scaling), dtype=np.float64), table, dynamic, out)
    split_pairs(_select_attend_batch, args, B * H, None)
    return torch.from_numpy(table), torch.from_numpy(dynamic), torch.from_numpy(out), ranks



def _run(q, addresses, capacity, P, slots, pages, counts, n_tokens, lo, scaling, out, workers=None) -> None:
    """Check the slots (raw reads must never pass a pool's end), then run `_paged_attention` (`split_pairs`)."""
    if not _slots_inside(slots, counts, capacity):
        raise InputError("paged_attention: a page slot lies outside its pool")
    split_pairs(_paged_attention, (q, addresses, capacity, P, slots, pages, counts, n_tokens, lo, scaling, out),
           slots.shape[0] * slots.shape[1], workers)
