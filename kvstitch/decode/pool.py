"""Paged KV pools in HND layout and the per-page key bounding boxes (PRKV Sec. 4.1-4.2, App. I).

One layer's cache is a tensor of pages ``(pages, kv_heads, 2, page_size, head_dim)``: the HND layout
puts one head's K and V of a page in one contiguous block, so retrieval is per (page, head)
without searching (Sec. 4.2 "Contiguous Memory Indexing").

- `HostPool` is the offload tier: it holds every token of the layer (pinned when CUDA is present) and
  is the source of truth; appends and restructures write here first.
- `DevicePool` is the working set on the compute device: a fixed number of slots per KV head, a
  page -> slot table per head and LRU eviction. A page already resident is never copied again.
- `PageBounds` is the page digest kept on the device: per page and KV head, the min and max of the
  page's keys (the bounding box of Quest / ArkVale / PRKV) or their mean and variance (`digest="moments"`).

On a CPU-only machine both pools live in host memory and the "transfer" is a memcpy, so the code path
is the same one that runs with an accelerator.
"""

from __future__ import annotations

import torch

from .transfer import BatchedTransfer

K, V = 0, 1  # index of keys / values in the HND page's "2" axis


def _pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


def _grown(t: torch.Tensor, size: int, fill: float = 0, dim: int = 0) -> torch.Tensor:
    """``t`` extended along ``dim`` to at least ``size`` entries (at least doubling), new ones = ``fill``."""
    have = t.shape[dim]
    if size <= have:
        return t
    shape = list(t.shape)
    shape[dim] = max(size, 2 * have) - have
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)


class HostPool:
    """Every K/V of one layer, paged HND; also the storage position -> original token position map.

    PRKV restructures the cache (static tokens moved to the front), so storage order differs from token
    order; ``token_pos[h, j]`` is the original position of the token stored at index ``j`` for KV head h.
    """

    def __init__(self, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 capacity_tokens: int = 0, pin: bool | None = None) -> None:
        self.num_kv_heads, self.page_size, self.head_dim, self.dtype = num_kv_heads, page_size, head_dim, dtype
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.n_tokens = 0
        self.data = self._alloc(max(1, _pages_for(capacity_tokens, page_size)))
        self.token_pos = torch.zeros(num_kv_heads, self.data.shape[0] * page_size, dtype=torch.long)
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None

    def _alloc(self, pages: int) -> torch.Tensor:
        shape = (pages, self.num_kv_heads, 2, self.page_size, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, pin_memory=self.pin)

    @property
    def n_pages(self) -> int:
        return _pages_for(self.n_tokens, self.page_size)

    @property
    def capacity_pages(self) -> int:
        return self.data.shape[0]

    def reserve(self, n_tokens: int) -> None:
        """Grow (doubling) so that `n_tokens` fit; existing pages keep their indices."""
        need = _pages_for(n_tokens, self.page_size)
        if need <= self.capacity_pages:
            return
        data = self._alloc(max(need, 2 * self.capacity_pages))  # pinned: not a torch.cat
        data[: self.capacity_pages].copy_(self.data)
        self.data = data
        self._flat = None
        self.token_pos = _grown(self.token_pos, data.shape[0] * self.page_size, dim=1)

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the contents with `keys`/`values` ``[kv_heads, n, head_dim]`` in token order."""
        n = keys.shape[1]
        self.n_tokens = 0
        self.reserve(n)
        self.write_prefix(keys, values, torch.arange(n).expand(self.num_kv_heads, n))
        self.n_tokens = n

    def write_prefix(self, keys: torch.Tensor, values: torch.Tensor, token_pos: torch.Tensor) -> None:
        """Overwrite storage ``[0, n)`` (per head) with the given K/V rows and their token positions."""
        n, P = keys.shape[1], self.page_size
        pages = _pages_for(n, P)
        for kind, rows in ((K, keys), (V, values)):
            padded = torch.zeros(self.num_kv_heads, pages * P, self.head_dim, dtype=self.dtype)
            padded[:, :n] = rows.to("cpu", self.dtype)
            self.data[:pages, :, kind] = padded.view(self.num_kv_heads, pages, P, self.head_dim).transpose(0, 1)
        self.token_pos[:, :n] = token_pos

    def flat(self, kind: int) -> torch.Tensor:
        """K (kind=0) or V (kind=1) blocks as a ``[pages * kv_heads, page_size, head_dim]`` view: row
        ``page * kv_heads + head`` is that (page, head) block (what a direct gather indexes)."""
        if self._flat is None:
            self._flat = (self.data[:, :, K].flatten(0, 1), self.data[:, :, V].flatten(0, 1))
        return self._flat[kind]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        """Append one token (``[kv_heads, 1, head_dim]``); returns its (page, offset in page)."""
        n = self.n_tokens
        if n + 1 > self.capacity_pages * self.page_size:
            self.reserve(n + 1)
        page, off = divmod(n, self.page_size)
        self.data[page, :, K, off] = k[:, 0]  # setitem copies across device / dtype
        self.data[page, :, V, off] = v[:, 0]
        self.token_pos[:, n] = n
        self.n_tokens += 1
        return page, off

    def rows(self, kind: int, end: int | None = None) -> torch.Tensor:
        """K (kind=0) or V (kind=1) of storage ``[0, end)`` as ``[kv_heads, end, head_dim]`` (a copy)."""
        end = self.n_tokens if end is None else end
        pages = _pages_for(end, self.page_size)
        block = self.data[:pages, :, kind].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)
        return block[:, :end]


class DevicePool:
    """The device working set of one layer: ``slots`` page slots per KV head, LRU-evicted.

    ``data[s, h]`` holds, for KV head h, the page ``slot_page[h, s]`` of the host pool (HND, so each head
    is an independent block). `fetch` makes a set of (head, page) resident with one batched transfer.
    """

    def __init__(self, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, slots: int) -> None:
        self.num_kv_heads, self.page_size, self.head_dim = num_kv_heads, page_size, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.data = torch.zeros((slots, num_kv_heads, 2, page_size, head_dim), dtype=dtype, device=self.device)
        self.slot_page = torch.full((num_kv_heads, slots), -1, dtype=torch.long)
        self.last_used = torch.full((num_kv_heads, slots), -1, dtype=torch.long)
        self.page_slot = torch.full((num_kv_heads, 1), -1, dtype=torch.long)

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    def _grow_pages(self, n_pages: int) -> None:
        self.page_slot = _grown(self.page_slot, n_pages, fill=-1, dim=1)

    def _grow_slots(self, slots: int) -> None:
        self.data = _grown(self.data, slots)
        self.slot_page = _grown(self.slot_page, slots, fill=-1, dim=1)
        self.last_used = _grown(self.last_used, slots, fill=-1, dim=1)

    def fetch(self, pages: torch.Tensor, host: HostPool, transfer: BatchedTransfer, clock: int) -> torch.Tensor:
        """Make ``pages`` (``[kv_heads, M]`` host page ids, distinct per row, CPU) resident; return their slots.

        Hits are only re-stamped; all misses move in one `BatchedTransfer.fetch` (Sec. 4.2). The pool grows
        when one step needs more than ``slots`` pages per head (dense layers, ``dense``).
        """
        H, M = pages.shape
        self._grow_pages(host.capacity_pages)
        self._grow_slots(M)
        heads = torch.arange(H).unsqueeze(1).expand(H, M)
        slots = self.page_slot.gather(1, pages)
        hit = slots >= 0
        self.last_used[heads[hit], slots[hit]] = clock  # `clock` is unique per call: hits sort last below
        miss = ~hit
        if miss.any():
            rank = miss.long().cumsum(1) - 1  # i-th miss of a head takes that head's i-th stalest slot
            lru_order = self.last_used.argsort(dim=1, stable=True)  # free (-1) and stalest first
            victims = lru_order.gather(1, rank.clamp(min=0))
            mh, mp, ms = heads[miss], pages[miss], victims[miss]
            old = self.slot_page[mh, ms]
            evicted = old >= 0
            self.page_slot[mh[evicted], old[evicted]] = -1
            self.slot_page[mh, ms] = mp
            self.page_slot[mh, mp] = ms
            self.last_used[mh, ms] = clock
            transfer.fetch(host.data, mp, mh, self.data, ms)
            slots = torch.where(miss, victims, slots)
        return slots

    def gather(self, slots: torch.Tensor, kind: int) -> torch.Tensor:
        """K (kind=0) or V (kind=1) of ``slots [kv_heads, M]`` (row h read for head h) as a contiguous
        ``[kv_heads, M * page_size, head_dim]``: one index_select over the (slot, head) blocks."""
        H, M = slots.shape
        index = (slots * H + torch.arange(H).unsqueeze(1)).flatten().to(self.device)
        rows = self.data[:, :, kind].flatten(0, 1).index_select(0, index)  # [H * M, P, D]
        return rows.view(H, M * self.page_size, self.head_dim)

    def write_token(self, page: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write-through of an appended token for the heads whose copy of `page` is resident."""
        if page >= self.page_slot.shape[1]:
            return
        slot = self.page_slot[:, page]
        heads = (slot >= 0).nonzero().flatten()
        if heads.numel():
            s, h = slot[heads].to(self.device), heads.to(self.device)
            self.data[s, h, K, offset] = k[h, 0].to(self.dtype)
            self.data[s, h, V, offset] = v[h, 0].to(self.dtype)

    def invalidate(self, stale: torch.Tensor) -> None:
        """Drop resident copies of the (head, page) pairs marked in ``stale`` (``[kv_heads, pages]`` bool)."""
        self._grow_pages(stale.shape[1])
        table = self.page_slot[:, : stale.shape[1]]
        drop = stale & (table >= 0)
        h, p = drop.nonzero(as_tuple=True)
        s = table[h, p]
        self.slot_page[h, s] = -1
        self.last_used[h, s] = -1
        table[h, p] = -1

    def resident(self) -> list[tuple[int, int, int]]:
        """(head, page, slot) triples currently resident (for consistency checks)."""
        h, s = (self.slot_page >= 0).nonzero(as_tuple=True)
        return list(zip(h.tolist(), self.slot_page[h, s].tolist(), s.tolist()))


class PageBounds:
    """The page digest kept on the device, per page and KV head, of one of two kinds (``digest``):

    - ``"box"``: the min / max of the page's keys (the bounding box of Quest and ArkVale's cuboid digest; PRKV
      recomputes it for the restructured pages, Alg. 1 line 14). Stored as ``[kv_heads, pages, 2 * head_dim]``
      = ``(kmax | -kmin)``: a new key extends a box with a single elementwise max of ``(k | -k)``, and the
      bound of `page_scores.box_scores` is a single matmul with ``(relu(q) | relu(-q))``.
    - ``"moments"``: the mean and per-dimension variance of the page's keys, ``(mu | var)``, kept from running
      sums ``(sum k | sum k^2)``; scored by `page_scores.moment_query`.

    A partially filled page digests its filled tokens only. `pages` gives the (kmin, kmax) view of boxes.
    """

    KINDS = ("box", "moments")

    def __init__(self, num_kv_heads: int, page_size: int, head_dim: int, device: torch.device,
                 digest: str = "box") -> None:
        if digest not in self.KINDS:
            raise ValueError(f"page digest must be one of {self.KINDS}, got {digest!r}")
        self.page_size, self.head_dim, self.device, self.kind = page_size, head_dim, torch.device(device), digest
        self.data = torch.zeros((num_kv_heads, 1, 2 * head_dim), device=self.device)  # the digests scored
        # moments: running (sum k | sum k^2) and the token count of each page
        self.sums = torch.zeros_like(self.data) if digest == "moments" else None
        self.count = torch.zeros(1, device=self.device) if digest == "moments" else None
        self._lagging: int | None = None  # a moments page whose digest lags its sums (`add_token`)

    def _reserve(self, pages: int) -> None:
        self.data = _grown(self.data, pages, dim=1)
        if self.sums is not None:
            self.sums, self.count = _grown(self.sums, pages, dim=1), _grown(self.count, pages)

    def reserve(self, pages: int) -> None:
        """Room for ``pages`` digests (appends within it never reallocate)."""
        self._reserve(pages)

    def rebuild(self, keys: torch.Tensor) -> None:
        """Recompute the pages covering ``keys`` (``[kv_heads, n, head_dim]``, storage ``[0, n)``)."""
        H, n, D = keys.shape
        P = self.page_size
        full, rest = divmod(n, P)
        self._reserve(full + (rest > 0))
        k = keys.to(self.device, torch.float32)
        if self.sums is not None:
            pages = full + (rest > 0)
            padded = torch.zeros(H, pages * P, D, device=self.device)
            padded[:, :n] = k
            paged = padded.view(H, pages, P, D)
            self.sums[:, :pages, :D], self.sums[:, :pages, D:] = paged.sum(2), paged.square().sum(2)
            self.count[:pages] = P
            if rest:
                self.count[full] = rest
            self._moments(slice(0, pages))
            if self._lagging is not None and self._lagging < pages:
                self._lagging = None
            return
        if full:
            paged = k[:, : full * P].reshape(H, full, P, D)
            self.data[:, :full, :D] = paged.amax(2)
            self.data[:, :full, D:] = -paged.amin(2)
        if rest:
            tail = k[:, full * P:]
            self.data[:, full, :D], self.data[:, full, D:] = tail.amax(1), -tail.amin(1)

    def _moments(self, pages) -> None:
        """``(mu | var)`` of ``pages`` (an index or slice) from their running sums."""
        D = self.head_dim
        count = self.count[pages].unsqueeze(-1)
        mean = self.sums[:, pages, :D] / count
        self.data[:, pages, :D] = mean
        self.data[:, pages, D:] = (self.sums[:, pages, D:] / count - mean.square()).clamp_(min=0)

    def add_token(self, page: int, offset: int, k: torch.Tensor) -> None:
        """Add one key ``[kv_heads, 1, head_dim]`` to page `page`'s digest (a new page starts at it)."""
        if page >= self.data.shape[1]:
            self._reserve(page + 1)
        k = k[:, 0].to(self.device, torch.float32)
        if self.sums is not None:
            both = torch.cat((k, k.square()), dim=-1)
            row = self.sums[:, page]
            if offset == 0:
                row.copy_(both)
            else:
                row.add_(both)
            self.count[page] = offset + 1
            if self._lagging is not None and self._lagging != page:
                self._moments(self._lagging)
            # the page being filled is in the local window, never ranked: its digest is due when it is read
            self._lagging = page
            return
        both = torch.cat((k, -k), dim=-1)
        row = self.data[:, page]
        if offset == 0:
            row.copy_(both)
        else:
            torch.maximum(row, both, out=row)

    def pages(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Boxes of pages ``[start, end)`` as ``[kv_heads, end - start, head_dim]`` (min, max)."""
        if self.kind != "box":
            raise ValueError("pages() gives bounding boxes; this digest keeps moments")
        D = self.head_dim
        return -self.data[:, start:end, D:], self.data[:, start:end, :D]

    def digests(self, start: int, end: int) -> torch.Tensor:
        """The digests of pages ``[start, end)``: ``[kv_heads, end - start, 2 * head_dim]`` (a view), ``(kmax |
        -kmin)`` or ``(mu | var)``."""
        self.settle(start, end)
        return self.data[:, start:end]

    def settle(self, start: int, end: int) -> None:
        """Bring the digests of pages ``[start, end)`` in `data` up to date (a moments page lags its sums)."""
        if self._lagging is not None and start <= self._lagging < end:
            self._moments(self._lagging)
            self._lagging = None


class WorkingSet:
    """The attended pages of one layer kept as contiguous K/V buffers ``[kv_heads, slots * page_size, D]``,
    updated in place: only the pages a step newly selects are copied in (into the slots of the pages it
    dropped), so attention reads the buffers directly instead of gathering every selected page each step.
    Used when host and device memory are one (CPU, ``offload="direct"``).

    The order of the slots is arbitrary (attention does not depend on it). ``bias [kv_heads, slots * P]``
    is 0 on filled rows and -inf on the unfilled rows of the partial last page, so it masks them inside
    the attention matmul. The page receiving appended tokens is re-read at every step (`touch`), and a
    restructured cache (PRKV refresh) drops everything (`clear`).
    """

    def __init__(self, host: HostPool, device: torch.device) -> None:
        self.host, self.device = host, torch.device(device)
        H, P, D = host.num_kv_heads, host.page_size, host.head_dim
        self.keys = torch.zeros(H, 0, D, dtype=host.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.bias = torch.zeros(H, 0, device=self.device)
        self.slot_page = torch.full((H, 0), -1, dtype=torch.long)
        self.page_slot = torch.full((H, 1), -1, dtype=torch.long)  # last column: a dummy for "no page"
        rows = torch.arange(P)
        self._row_bias = torch.zeros(P + 1, P).masked_fill_(rows >= torch.arange(P + 1).unsqueeze(1), float("-inf"))
        self._heads = torch.arange(H).unsqueeze(1)
        self.copied = 0  # (page, head) blocks copied in

    @property
    def slots(self) -> int:
        return self.slot_page.shape[1]

    def clear(self) -> None:
        self.slot_page = torch.full_like(self.slot_page, -1)
        self.page_slot.fill_(-1)

    def touch(self, page: int) -> None:
        """`page` is receiving a token: its resident copies are stale."""
        if page < self.page_slot.shape[1] - 1:
            self.page_slot[:, page] = -1

    def update(self, pages: torch.Tensor) -> None:
        """Make the buffers hold exactly ``pages [kv_heads, M]`` (distinct per row)."""
        H, M = pages.shape
        host, P = self.host, self.host.page_size
        if self.page_slot.shape[1] <= host.capacity_pages:
            self.page_slot = torch.cat([self.page_slot[:, :-1], torch.full(
                (H, host.capacity_pages + 1 - self.page_slot.shape[1] + 1), -1, dtype=torch.long)], dim=1)
        dummy = self.page_slot.shape[1] - 1
        if M != self.slots:  # the step's page count changed: reload everything into M slots
            self.keys = self.keys.new_empty(H, M * P, self.keys.shape[-1])
            self.values = torch.empty_like(self.keys)
            self.bias = self.bias.new_empty(H, M * P)
            self.page_slot.fill_(-1)
            self.slot_page = torch.full((H, M), -1, dtype=torch.long)
            miss_h, miss_i = self._heads.expand(H, M).flatten(), torch.arange(M).repeat(H)
            free_s = miss_i
        else:
            slots = self.page_slot.gather(1, pages)
            hit = slots >= 0
            if bool(hit.all()):
                return
            used = torch.zeros(H, M + 1, dtype=torch.bool).scatter_(1, torch.where(hit, slots, M), True)[:, :M]
            miss_h, miss_i = (~hit).nonzero(as_tuple=True)  # row-major: grouped by head, like the free slots
            free_h, free_s = (~used).nonzero(as_tuple=True)
            old = self.slot_page[free_h, free_s]
            self.page_slot[free_h, torch.where(old >= 0, old, dummy)] = -1
        new = pages[miss_h, miss_i]
        self.page_slot[miss_h, new] = free_s
        self.slot_page[miss_h, free_s] = new
        src = new * H + miss_h
        dst = miss_h * M + free_s
        self.keys.view(H * M, P, -1).index_copy_(0, dst, host.flat(K).index_select(0, src))
        self.values.view(H * M, P, -1).index_copy_(0, dst, host.flat(V).index_select(0, src))
        filled = (host.n_tokens - new * P).clamp(0, P)
        self.bias.view(H * M, P).index_copy_(0, dst, self._row_bias.index_select(0, filled))
        self.copied += new.numel()

    def tokens(self) -> torch.Tensor:
        """Storage index of every buffer row ``[kv_heads, slots * P]`` (rows of empty slots point at 0)."""
        P = self.host.page_size
        return (self.slot_page.clamp(min=0).unsqueeze(-1) * P + torch.arange(P)).flatten(1)
