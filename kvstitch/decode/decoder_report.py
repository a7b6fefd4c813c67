"""What a `SparseDecoder` reports (a base class it inherits): what its budget counts, the bytes it holds, and its
statistics (transfers, selection size, static-set refreshes, recall in diagnostic mode)."""

from __future__ import annotations

import torch


class DecoderReport:
    """The report methods of `SparseDecoder`, over the state it keeps (``layers``, ``transfer``, ``recall`` and its
    counters)."""

    def budget_counts(self) -> str:
        """What ``kv_budget`` (k) counts, in words (benches print it)."""
        if self.policy.select_all():
            return "everything (dense)"
        if self.window_in_budget:
            return "sinks and the local window inside k"
        return f"sinks inside k, the {self.window}-token local window on top"

    def selection_totals(self) -> tuple[int, int]:
        """(tokens attended, tokens a dense step would have attended), summed over every attend so far."""
        return self._selected_tokens, self._context_tokens

    def kv_bytes(self) -> dict:
        """Bytes this decoder holds: ``host`` (every K/V, the offload tier: pinned host memory with an
        accelerator, the one memory on a CPU) and ``device`` (page bounds, device pool / working set)."""
        host = device = 0
        for st in self.layers:
            if st is None:
                continue
            for t in self._host_tensors(st):
                host += t.numel() * t.element_size()
            for t in self._device_tensors(st):
                device += t.numel() * t.element_size()
        return {"host": host, "device": device}

    def _host_tensors(self, st) -> list[torch.Tensor]:
        return [st.host.data, st.host.token_pos]

    def _device_tensors(self, st) -> list[torch.Tensor]:
        out = [st.bounds.data] + ([st.obs_q] if st.obs_q is not None else [])
        if st.device is not None:
            out.append(st.device.data)
        if st.ws is not None:
            out += [st.ws.keys, st.ws.values]
        return out

    def static_ratios(self) -> list[float | None]:
        return [st.static_ratio if st else None for st in self.layers]

    def stats(self) -> dict:
        """Transfers, selection size, static-set refreshes and (diagnostic mode) recall."""
        out = {
            "policy": self.policy.name,
            "kv_budget": self.kv_budget,
            "budget_counts": self.budget_counts(),
            "page_size": self.page_size,
            "local_window": self.window,
            "steps": self.step,
            "offload": self.offload,
            "pages_read": self._pages_read,       # (page, KV head) blocks attended over
            # (page, KV head) blocks host -> device pool, or (direct) into the working sets
            "pages_copied": self.transfer.pages + sum(st.ws.copied for st in self.layers if st and st.ws),
            "bytes_copied": self.transfer.bytes,
            "transfers": self.transfer.copies,    # bulk copies (at most one per attend)
            "mean_selected_tokens": self._selected_tokens / self._attends if self._attends else 0.0,
            "static_refreshes": sum(max(0, len(st.static_steps) - 1) for st in self.layers if st),
            "observation_window": max((st.obs_q.shape[1] for st in self.layers if st and st.obs_q is not None),
                                      default=0),
            "static_refresh_bytes": self._refresh_bytes,  # keys read to re-score the static set
            "static_ratio": self.static_ratios(),
        }
        if any(self.recall.history):
            out.update(self.recall.summary())
        return out
