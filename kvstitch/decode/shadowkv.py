"""ShadowKV (Sun et al., 2024), the PRKV paper's third offloading baseline, as a registered decode policy.

What ShadowKV keeps where, per layer (its Sec. 4 and its reference implementation):

- **device**: a low-rank factorisation of the *pre-RoPE* prefill keys. The keys of all KV heads are
  concatenated per token (``[n, Hkv*D]``) and truncated by SVD: ``K_pre ≈ A @ B`` with ``A = U_r S_r``
  ``[n, r]`` and ``B = V_r^T`` ``[r, Hkv*D]``. The cache holds post-RoPE keys; they are un-rotated exactly
  with `kvstitch.core.rope.rerotate` by minus their positions.
- **device**: chunk landmarks, the mean of the post-RoPE keys of each chunk of ``chunk_size`` tokens, and
  the static *outlier chunks*, the chunks whose keys are least similar to their landmark (lowest minimum
  cosine similarity, per KV head), kept exact (K and V) and attended at every step.
- **device**: the local tokens (the end of the prompt, rounded to chunks) and every generated token, exact.
- **host**: the values of the prompt (offloaded).

Each step, per KV head, the query scores the landmarks (softmax per query head, max over the GQA group,
as ShadowKV does), the top chunks are chosen, their values are fetched from the host (one gathered copy),
their keys are rebuilt from the low-rank factors and re-rotated to their positions, and attention runs over
outliers + selected chunks + local/generated tokens.

Scaling to a small model (documented defaults; every one is a policy field):

- ``rank``: ShadowKV uses 160 for Llama-3-8B, whose keys have ``Hkv*D = 8*128 = 1024`` dims, i.e. 15.6%
  of them. ``rank=None`` keeps that share: ``round(160/1024 * Hkv*D)`` (30 for SmolLM2-135M's 3x64).
- ``chunk_size``: 8 tokens, as in ShadowKV (the decoder's ``page_size`` does not apply).
- ``outlier_chunks``: ShadowKV keeps 48 outlier chunks next to a 2048-token sparse budget. ``None`` keeps
  that proportion of the budget: ``round(48 * k / 2048)`` chunks (24 at k = 1024), at least 1.

Budget (the same accounting as every policy here, `plan`): ``k`` counts the outlier chunks, the selected
chunks and the generated tokens that have left the local window (ShadowKV keeps every generated token
exact, having no landmark or factors for it); the local window (64 tokens, rounded out to whole chunks)
comes on top (``window_in_budget=True``: inside). ShadowKV's own "sparse budget" is only the selected
chunks; here the outliers and generated tokens come out of ``k`` so that every policy attends as many
tokens and recall compares like with like. No explicit sinks: the first chunk is normally an outlier.
Values are fetched every step (no device-side chunk cache); ``bytes_copied`` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvstitch.core.errors import BadDecodeOption, InputError
from kvstitch.core.rope import rerotate
from .attention import grouped_attention
from .decoder import SparseDecoder
from .policies import DecodePolicy, register
from .recall import attention_recall, oracle_recall

LLAMA3_8B_KEY_DIMS, SHADOWKV_RANK = 1024, 160
SHADOWKV_OUTLIERS, SHADOWKV_BUDGET = 48, 2048


def _rope_table(n: int, inv_freq: torch.Tensor, device) -> torch.Tensor:
    """``(cos | sin)`` ``[n, D]`` (float32) of positions ``0..n-1``: angles in float64 (as `rerotate`), computed
    once at prefill so that a step's re-rotation is a table lookup, not ~m*D trigonometric calls."""
    angle = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq.to(device, torch.float64)
    return torch.cat((angle.cos(), angle.sin()), dim=-1).float()


def _grow(t: torch.Tensor, need: int) -> torch.Tensor:
    """``t [H, cap, D]`` with capacity for at least ``need`` rows along dim 1 (doubling)."""
    if need <= t.shape[1]:
        return t
    out = t.new_zeros(t.shape[0], max(need, 2 * t.shape[1]), t.shape[2])
    out[:, : t.shape[1]] = t
    return out


@dataclass
class _ShadowLayer:
    n: int                       # tokens in the layer (prompt + generated)
    local_start: int             # tokens [local_start, n) are exact on the device
    values_host: torch.Tensor    # [Hkv, cap, D] the offloaded values (host)
    keys_host: torch.Tensor      # [Hkv, cap, D] exact post-RoPE keys, read only by the diagnostic mode
    recent_k: torch.Tensor       # [Hkv, cap, D] exact keys of [local_start, n) (device)
    recent_v: torch.Tensor
    A: torch.Tensor              # [local_start, r]   low-rank factor (device)
    B: torch.Tensor              # [Hkv, r, D]
    landmarks: torch.Tensor      # [Hkv, M, D] of the non-outlier chunks (device)
    landmark_chunk: torch.Tensor  # [Hkv, M] their chunk ids
    outlier_k: torch.Tensor      # [Hkv, O*C, D] exact outlier chunks (device)
    outlier_v: torch.Tensor
    outlier_tok: torch.Tensor    # [Hkv, O*C] their token positions
    rope: torch.Tensor           # [local_start, D] float32 (cos | sin) of the chunked positions (float64 angles)
    sliding_window: None = None
    obs_q: None = None
    static_ratio: None = None
    static_steps: list = field(default_factory=list)
    selected: torch.Tensor | None = None  # last step's chosen chunk ids [Hkv, m]
    ws: None = None


class ShadowKVDecoder(SparseDecoder):
    """`SparseDecoder` interface over ShadowKV's storage (module docstring). Sliding-window layers (Gemma 3)
    attend densely over their window through the base class, as for every policy."""

    def __init__(self, policy, kv_budget, num_layers, num_q_heads, num_kv_heads, head_dim, page_size=32,
                 device="cpu", dtype=torch.float32, device_pages=None, scaling=None, window_in_budget=False,
                 offload="auto", op_threads=1):
        super().__init__(policy, kv_budget, num_layers, num_q_heads, num_kv_heads, head_dim, policy.chunk_size,
                         device, dtype, device_pages, scaling, window_in_budget, offload, op_threads)
        hd = num_kv_heads * head_dim
        self.rank = policy.rank if policy.rank is not None else max(1, round(SHADOWKV_RANK / LLAMA3_8B_KEY_DIMS * hd))
        if self.rank > hd:
            raise InputError(f"shadowkv: rank={self.rank} exceeds the key dimension {hd} (= kv heads x head_dim)")
        C = policy.chunk_size
        most = (self.cap - self.window) // C - 1  # outliers leave room for the window and one chunk
        want = (policy.outlier_chunks if policy.outlier_chunks is not None
                else max(1, round(SHADOWKV_OUTLIERS * kv_budget / SHADOWKV_BUDGET)))
        if want > most:
            if policy.outlier_chunks is not None:
                raise InputError(f"shadowkv: {want} outlier chunks of {C} tokens do not fit in kv_budget={kv_budget}")
            want = max(0, most)
        self.outlier_chunks = want
        self._reconstructed = 0

    # ----------------------------------------------------------------------------------- prefill
    def load_prefill(self, layer, keys, values, obs_queries=None, sliding_window=None, scaling=None,
                     inv_freq=None):
        if sliding_window is not None:
            return super().load_prefill(layer, keys, values, obs_queries, sliding_window, scaling, inv_freq)
        if scaling is not None:
            self.scaling = scaling
        Hkv, n, D = self.check_prefill(layer, keys, values)
        if inv_freq is None:
            raise InputError("shadowkv needs each layer's RoPE inv_freq (load_prefill(..., inv_freq=...)) to "
                             "un-rotate the cached keys")
        C, dev = self.page_size, self.device
        keys_f, values_f = keys.to(dev, torch.float32), values.to(dev, torch.float32)
        local_start = (max(0, n - self.window) // C) * C
        nc = local_start // C
        O = min(self.outlier_chunks, nc)
        cap = n + self.reserve_tokens
        values_host = torch.zeros(Hkv, cap, D, dtype=self.dtype)
        keys_host = torch.zeros(Hkv, cap, D, dtype=self.dtype)
        values_host[:, :n], keys_host[:, :n] = values.to("cpu", self.dtype), keys.to("cpu", self.dtype)
        recent_k = torch.zeros(Hkv, n - local_start + self.reserve_tokens, D, dtype=self.dtype, device=dev)
        recent_v = torch.zeros_like(recent_k)
        recent_k[:, : n - local_start] = keys_f[:, local_start:].to(self.dtype)
        recent_v[:, : n - local_start] = values_f[:, local_start:].to(self.dtype)

        ctx = keys_f[:, :local_start]  # the chunked region, post-RoPE
        pre = rerotate(ctx, -torch.arange(local_start, device=dev), inv_freq)  # exact un-rotation
        r = min(self.rank, local_start) if local_start else 0
        if r:
            flat = pre.transpose(0, 1).reshape(local_start, Hkv * D)  # [n, Hkv*D]: all heads per token
            U, S, Vh = torch.linalg.svd(flat, full_matrices=False)
            A = (U[:, :r] * S[:r]).to(self.dtype)
            B = Vh[:r].reshape(r, Hkv, D).transpose(0, 1).contiguous().to(self.dtype)  # [Hkv, r, D]
        else:
            A, B = torch.zeros(0, 1, device=dev, dtype=self.dtype), torch.zeros(Hkv, 1, D, device=dev, dtype=self.dtype)
        chunks = ctx.view(Hkv, nc, C, D)
        marks = chunks.mean(dim=2)  # [Hkv, nc, D]
        sim = torch.nn.functional.cosine_similarity(chunks, marks.unsqueeze(2), dim=-1).amin(dim=-1)  # [Hkv, nc]
        outliers = sim.topk(O, dim=1, largest=False).indices.sort(dim=1).values  # [Hkv, O]
        keep = torch.ones(Hkv, nc, dtype=torch.bool, device=dev)
        keep.scatter_(1, outliers, False)
        rest = torch.arange(nc, device=dev).expand(Hkv, nc)[keep].view(Hkv, nc - O)
        out_tok = (outliers.unsqueeze(-1) * C + torch.arange(C, device=dev)).flatten(1)  # [Hkv, O*C]
        idx = out_tok.unsqueeze(-1).expand(-1, -1, D)
        self.layers[layer] = _ShadowLayer(
            n, local_start, values_host, keys_host, recent_k, recent_v, A, B,
            marks.gather(1, rest.unsqueeze(-1).expand(-1, -1, D)).to(self.dtype), rest,
            keys_f.gather(1, idx).to(self.dtype), values_f.gather(1, idx).to(self.dtype), out_tok,
            _rope_table(local_start, inv_freq, dev))

    # ---------------------------------------------------------------------------------- decode
    def _append(self, layer, k, v):
        st = self._layer(layer)
        if not isinstance(st, _ShadowLayer):
            return super()._append(layer, k, v)
        st.values_host = _grow(st.values_host, st.n + 1)
        st.keys_host = _grow(st.keys_host, st.n + 1)
        st.values_host[:, st.n] = v[:, 0].to("cpu", self.dtype)
        st.keys_host[:, st.n] = k[:, 0].to("cpu", self.dtype)
        j = st.n - st.local_start
        st.recent_k, st.recent_v = _grow(st.recent_k, j + 1), _grow(st.recent_v, j + 1)
        st.recent_k[:, j] = k[:, 0].to(self.device, self.dtype)
        st.recent_v[:, j] = v[:, 0].to(self.device, self.dtype)
        st.n += 1

    def reconstruct_keys(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys of chunked-region ``tokens [Hkv, m]`` rebuilt from the low-rank factors: ``A[t] @ B_h``
        (pre-RoPE), re-rotated to position t -> ``[Hkv, m, D]`` (float32)."""
        st = self._layer(layer)
        Hkv, m = tokens.shape
        rows = st.A.float().index_select(0, tokens.flatten()).view(Hkv, m, -1)
        pre = torch.bmm(rows, st.B.float())  # [Hkv, m, D] pre-RoPE
        cos, sin = st.rope.index_select(0, tokens.flatten()).view(Hkv, m, -1).chunk(2, dim=-1)
        x1, x2 = pre.chunk(2, dim=-1)  # rotate-half RoPE, as `kvstitch.core.rope.rerotate` applies it
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _attend(self, layer, q, scaling):
        st = self._layer(layer)
        if not isinstance(st, _ShadowLayer):
            return super()._attend(layer, q, scaling)
        self.scaling = scaling
        H, C, D = self.num_kv_heads, self.page_size, self.head_dim
        n_local = st.n - st.local_start
        n_cand = st.landmarks.shape[1]
        spare = self.cap - st.outlier_tok.shape[1] - n_local
        n_dyn = max(0, min(spare // C, n_cand))
        if n_dyn == n_cand:
            chosen = st.landmark_chunk
        elif n_dyn == 0:
            chosen = st.landmark_chunk[:, :0]
        else:  # landmark scores: softmax per query head, max over the GQA group (ShadowKV)
            logits = (q.to(self.device).float().view(H, -1, D) @ st.landmarks.float().transpose(1, 2)) * scaling
            best = logits.softmax(dim=-1).amax(dim=1)  # [H, n_cand]
            chosen = st.landmark_chunk.gather(1, best.topk(n_dyn, dim=1).indices)
        st.selected = chosen
        sel_tok = (chosen.unsqueeze(-1) * C + torch.arange(C, device=self.device)).flatten(1)  # [H, m]
        m = sel_tok.shape[1]
        if m:  # the sparse fetch: values from the host in one gathered copy, keys rebuilt on the device
            cap = st.values_host.shape[1]
            host_idx = (sel_tok.cpu() + torch.arange(H).unsqueeze(1) * cap).flatten()
            sel_v = st.values_host.view(H * cap, D).index_select(0, host_idx).view(H, m, D).to(self.device)
            sel_k = self.reconstruct_keys(layer, sel_tok).to(self.dtype)
            self.transfer.copies += 1
            self.transfer.pages += chosen.numel()
            self.transfer.bytes += sel_v.numel() * sel_v.element_size()
            self._reconstructed += sel_tok.numel()
        else:
            sel_k = sel_v = st.recent_k[:, :0]
        keys = torch.cat([st.outlier_k, sel_k, st.recent_k[:, :n_local]], dim=1)
        values = torch.cat([st.outlier_v, sel_v, st.recent_v[:, :n_local]], dim=1)
        out, _ = grouped_attention(q, keys, values, scaling)
        self._attends += 1
        self._selected_tokens += keys.shape[1]
        self._context_tokens += st.n
        if self.diagnostic:
            tokens = torch.cat([st.outlier_tok, sel_tok,
                                torch.arange(st.local_start, st.n, device=self.device).expand(H, -1)], dim=1)
            dense_out, probs = grouped_attention(q, st.keys_host[:, : st.n].to(self.device),
                                                 st.values_host[:, : st.n].to(self.device), scaling)
            valid = torch.ones_like(tokens, dtype=torch.bool)
            self.recall.record(layer, attention_recall(probs, tokens, valid), oracle_recall(probs, tokens.shape[1]),
                               (out.float() - dense_out.float()).abs().max().item(),
                               oracle_recall(probs, tokens.shape[1], shared=True))
        return out

    # ----------------------------------------------------------------------------------- report
    def _host_tensors(self, st):
        if not isinstance(st, _ShadowLayer):
            return super()._host_tensors(st)
        return [st.values_host, st.keys_host]

    def _device_tensors(self, st):
        if not isinstance(st, _ShadowLayer):
            return super()._device_tensors(st)
        return [st.recent_k, st.recent_v, st.A, st.B, st.landmarks, st.outlier_k, st.outlier_v, st.rope]

    def budget_counts(self) -> str:
        where = "inside k" if self.window_in_budget else "on top"
        return (f"outlier chunks, selected chunks and generated tokens past the window inside k, the "
                f"{self.window}-token local window {where}")

    def stats(self) -> dict:
        out = super().stats()
        out.update(chunk_size=self.page_size, rank=self.rank, outlier_chunks=self.outlier_chunks,
                   reconstructed_keys=self._reconstructed)
        return out


@register
@dataclass
class ShadowKV(DecodePolicy):
    """ShadowKV (Sun et al., 2024): low-rank pre-RoPE keys + chunk landmarks + static outlier chunks on the
    device, values offloaded, sparse fetch of the selected chunks (`ShadowKVDecoder`, module docstring)."""

    name: ClassVar[str] = "shadowkv"
    decoder_class: ClassVar[type] = ShadowKVDecoder
    sinks: int = 0
    chunk_size: int = 8
    rank: int | None = None
    outlier_chunks: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("chunk_size", "rank", "outlier_chunks"):
            v = getattr(self, name)
            low = 0 if name == "outlier_chunks" else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise BadDecodeOption(f"shadowkv: {name} must be an integer >= {low}, got {v!r}")

    def page_scores(self, q, kmin, kmax, first_page):  # the decoder scores landmarks itself
        raise NotImplementedError("shadowkv scores chunk landmarks in ShadowKVDecoder")


