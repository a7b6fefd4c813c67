"""CPU only (numba): a batched decode step's appends in one call. Every sparse row's new token goes into its host
pool, its token-position map and its page digest (box, or the moments digest's running sums and the one page
settled late), bit for bit what each row's own `HostPool.append` and `PageBounds.add_token` write."""

from __future__ import annotations

import numpy as np
import torch

from kvstitch.core.errors import InputError

from .kernel_common import addresses, numba

if numba is not None:
    from .kernel_common import f32_pointer, i64_pointer  # defined only with numba (the `fast` extra)

    @numba.njit(nogil=True, fastmath=False, cache=True)
    def _append_rows(keys, values, P, pools, pool_pages, positions, position_cap, digests, digest_cap, sums, counts,
                     ints):
        """One new token per row: row ``b``'s ``keys / values [b] [Hkv, D]`` into its pool (addresses ``pools[b]``,
        ``[pool_pages, Hkv, 2, P, D]``) at page ``ints[b, 0]``, offset ``ints[b, 1]``; its token position
        ``ints[b, 2]`` into the map ``[Hkv, position_cap]``; and its page digest ``[Hkv, digest_cap, 2D]``
        updated as `PageBounds.add_token` does: the box ``(kmax | -kmin)`` when ``sums[b]`` is 0, else the running
        ``(sum k | sum k^2)`` and token count of the moments digest, the page ``ints[b, 3]`` (if >= 0) settled
        from its sums (the one lagging page)."""
        B, H, D = keys.shape
        for b in range(B):
            page, off, n, lag = ints[b, 0], ints[b, 1], ints[b, 2], ints[b, 3]
            pool = numba.carray(f32_pointer(pools[b]), (pool_pages[b], H, 2, P, D))
            pos = numba.carray(i64_pointer(positions[b]), (H, position_cap[b]))
            data = numba.carray(f32_pointer(digests[b]), (H, digest_cap[b], 2 * D))
            for h in range(H):
                k, v = keys[b, h], values[b, h]
                pool[page, h, 0, off, :] = k
                pool[page, h, 1, off, :] = v
                pos[h, n] = n
                if sums[b] == 0:
                    row = data[h, page]
                    for d in range(D):
                        if off == 0:
                            row[d], row[D + d] = k[d], -k[d]
                        else:
                            row[d], row[D + d] = max(row[d], k[d]), max(row[D + d], -k[d])
            if sums[b] == 0:
                continue
            total = numba.carray(f32_pointer(sums[b]), (H, digest_cap[b], 2 * D))
            count = numba.carray(f32_pointer(counts[b]), (digest_cap[b],))
            for h in range(H):
                row, k = total[h, page], keys[b, h]
                for d in range(D):
                    if off == 0:
                        row[d], row[D + d] = k[d], k[d] * k[d]
                    else:
                        row[d], row[D + d] = row[d] + k[d], row[D + d] + k[d] * k[d]
            count[page] = off + 1
            if lag >= 0:
                c = count[lag]
                for h in range(H):
                    for d in range(D):
                        mean = total[h, lag, d] / c
                        data[h, lag, d] = mean
                        data[h, lag, D + d] = max(total[h, lag, D + d] / c - mean * mean, np.float32(0.0))


def append_rows(keys: torch.Tensor, values: torch.Tensor, hosts: list, bounds: list) -> None:
    """CPU only (float32 host pools, numba). Append one token per row, as `HostPool.append` followed by
    `PageBounds.add_token` do for each, in one call: row ``b``'s ``keys / values [b] [Hkv, D]`` to its host pool
    ``hosts[b]`` and page digests ``bounds[b]`` (the same values, bit for bit)."""
    B, H, D = keys.shape
    ints = np.empty((B, 4), dtype=np.int64)
    for b, (host, digest) in enumerate(zip(hosts, bounds)):
        n = host.n_tokens
        if n + 1 > host.capacity_pages * host.page_size:
            host.reserve(n + 1)
        page, off = divmod(n, host.page_size)
        if page >= digest.data.shape[1]:
            digest.reserve(page + 1)
        lag = digest._lagging if digest.sums is not None and digest._lagging not in (None, page) else -1
        ints[b] = (page, off, n, lag)
    digests = [t for d in bounds for t in ((d.data,) if d.sums is None else (d.data, d.sums, d.count))]
    for t in [h.data for h in hosts] + [h.token_pos for h in hosts] + digests:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise InputError("append_rows writes contiguous CPU pools, position maps and digests only")
    if any(t.dtype != torch.float32 for t in digests) or any(h.token_pos.dtype != torch.int64 for h in hosts):
        raise InputError("append_rows: digests must be float32 and position maps int64")
    if any(h.data.dtype != torch.float32 or h.data.shape[1:] != (H, 2, hosts[0].page_size, D) for h in hosts):
        raise InputError(f"append_rows: every pool must be float32 [*, {H}, 2, {hosts[0].page_size}, {D}]")
    moments = [d.sums is not None for d in bounds]
    _append_rows(keys.float().contiguous().numpy(), values.float().contiguous().numpy(), hosts[0].page_size,
                 addresses([h.data for h in hosts]), np.array([h.data.shape[0] for h in hosts], dtype=np.int64),
                 addresses([h.token_pos for h in hosts]), np.array([h.token_pos.shape[1] for h in hosts], dtype=np.int64),
                 addresses([d.data for d in bounds]), np.array([d.data.shape[1] for d in bounds], dtype=np.int64),
                 np.array([d.sums.data_ptr() if m else 0 for d, m in zip(bounds, moments)], dtype=np.int64),
                 np.array([d.count.data_ptr() if m else 0 for d, m in zip(bounds, moments)], dtype=np.int64), ints)
    for host, digest, m, (page, _, _, _) in zip(hosts, bounds, moments, ints):
        host.n_tokens += 1
        if m:
            digest._lagging = int(page)

