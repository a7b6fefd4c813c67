"""Batched host -> device KV transfer (PRKV Sec. 4.2, Fig. 5 right).

Instead of one copy per page, the missing (page, head) blocks of a step are gathered into one staging
buffer (pinned when CUDA is present), moved with a single copy, and scattered into the device pool.
The counters are what `SparseDecoder.stats()` reports and what the tests count.
"""

from __future__ import annotations

import torch


class BatchedTransfer:
    """Gather -> one copy -> scatter, with counters: ``copies`` (bulk copies issued), ``pages``
    ((page, head) blocks moved) and ``bytes``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pin = torch.cuda.is_available()
        self._staging: torch.Tensor | None = None
        self._in_flight = None  # CUDA event of the last copy out of the staging buffer
        self.copies = self.pages = self.bytes = 0

    def _buffer(self, n: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        st = self._staging
        if st is None or st.shape[0] < n or st.shape[1:] != block_shape or st.dtype != dtype:
            rows = max(n, 2 * st.shape[0]) if st is not None and st.shape[1:] == block_shape else n
            self._staging = torch.empty((rows, *block_shape), dtype=dtype, pin_memory=self.pin)
        elif self._in_flight is not None:
            self._in_flight.synchronize()  # the previous async copy may still read the buffer
        return self._staging[:n]

    def fetch(self, host_data: torch.Tensor, pages: torch.Tensor, heads: torch.Tensor,
              dev_data: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy host blocks ``host_data[pages[i], heads[i]]`` into ``dev_data[slots[i], heads[i]]``.

        ``host_data``/``dev_data`` are HND pools ``(pages|slots, kv_heads, 2, page_size, head_dim)``;
        the index tensors are 1-D CPU longs of equal length.
        """
        n = pages.numel()
        if n == 0:
            return
        H = host_data.shape[1]
        block_shape = tuple(host_data.shape[2:])
        staging = self._buffer(n, block_shape, host_data.dtype)
        torch.index_select(host_data.view(-1, *block_shape), 0, pages * H + heads, out=staging)  # gather
        moved = staging.to(self.device, non_blocking=self.pin)  # the one copy (a no-op move on CPU)
        if self.pin and self.device.type == "cuda":
            self._in_flight = torch.cuda.Event()
            self._in_flight.record()
        index = (slots * H + heads).to(self.device)
        dev_data.view(-1, *block_shape).index_copy_(0, index, moved)  # scatter into the device pool
        self.copies += 1
        self.pages += n
        self.bytes += staging.numel() * staging.element_size()
