"""`SparseDecoder`: per-layer paged KV with offloading and budgeted sparse attention (PRKV Sec. 4).

Per layer it keeps a `HostPool` (everything, the offload tier), a `DevicePool` (working set), and the
key bounding boxes (`PageBounds`, on the device). Each decode step, per layer:

1. ``append``: the new token goes to the host pool (source of truth), its page's box, and the device
   copy of its page if resident;
2. ``attend``: static policies refresh their static set every T steps (Alg. 1); the `PagePlan` splits
   the budget into front (sinks + static), dynamic and local pages; the policy ranks the candidate
   pages per KV head; missing (page, head) blocks come over in one batched transfer (Sec. 4.2); GQA
   attention runs over the selected pages only. With ``diagnostic`` set, dense attention runs too
   and the recall (Eq. 3) is recorded.

``kv_budget`` is the paper's ``k`` (PRKV Sec. 3.5 / 5.1): attended tokens per layer and KV head of sinks,
static set and dynamic pages; the 64-token local window comes on top (``window_in_budget=True``: inside,
the old accounting). Sinks and window are rounded out to whole pages (default 32 tokens, PRKV Sec. 5.1),
see `plan`. The page choice is made on the host (its page ids decide what
to copy), so each sparse step has one device -> host sync per layer, as in ArkVale / PRKV.

Layers with a ``sliding_window`` (Gemma 3 local layers) attend densely over exactly their window: it is
smaller than any useful budget, so there is nothing to select (their host pool still keeps every token).
One sequence per decoder (batch size 1). What a decoder reports is in `decoder_report`; the sparse rows of a
batched step run on threads in `row_threads.attend_rows`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kvstitch.core.errors import InputError
from . import paged_kernel, rank_kernel
from .attention import biased_attention, grouped_attention
from .decoder_report import DecoderReport
from .plan import PagePlan, attended_cap, check_budget, front_pages, pages_for, plan_step
from .policies import DecodePolicy, make_policy, policy_budget
from .pool import K, V, DevicePool, HostPool, PageBounds, WorkingSet
from .recall import RecallMeter, attention_recall, oracle_recall
from .page_scores import group_mean, observation_probs
from .static import online_static_ratio, pool_in_token_order, static_permutation
from .row_threads import attend_rows  # noqa: F401  (re-exported: the engine's batch imports it here)
from .transfer import BatchedTransfer


@dataclass
class _LayerState:
    host: HostPool
    device: DevicePool
    bounds: PageBounds
    sliding_window: int | None
    front: int                       # pages [0, front) always attended (sinks + static set)
    static_ratio: float | None = None
    obs_q: torch.Tensor | None = None  # [Hq, w, D]: queries of the last w tokens (static policies), a ring
    obs_head: int = 0                  # ring index of the oldest query in obs_q
    static_steps: list[int] = field(default_factory=list)  # steps at which the static set was chosen
    selected: torch.Tensor | None = None  # last step's page table [Hkv, M]
    ranked: tuple | None = None  # (step, front, n_dynamic, dynamic pages [Hkv, n_dynamic]) of the last ranking
    ws: WorkingSet | None = None  # direct mode: the attended pages as contiguous buffers


class SparseDecoder(DecoderReport):
    """See the module docstring; build one with `make_decoder`."""

    def __init__(self, policy: DecodePolicy, kv_budget: int, num_layers: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int = 32, device="cpu",
                 dtype: torch.dtype = torch.float32, device_pages: int | None = None,
                 scaling: float | None = None, window_in_budget: bool = False, offload: str = "auto",
                 op_threads: int | None = 1) -> None:
        if num_q_heads % num_kv_heads:
            raise InputError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if page_size < 1 or kv_budget < 1:
            raise InputError(f"page_size and kv_budget must be positive, got {page_size}, {kv_budget}")
        self.policy, self.kv_budget, self.page_size = policy, kv_budget, page_size
        self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim = (
            num_layers, num_q_heads, num_kv_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        if offload not in ("auto", "pool", "direct"):
            raise InputError(f"offload must be auto, pool or direct, got {offload!r}")
        if offload == "direct" and self.device.type != "cpu":
            raise InputError("offload='direct' reads the host pool in place: only for a CPU device")
        # "direct": host and compute memory are one (CPU), so attention gathers the selected pages straight
        # from the host pool; "pool": the device pool + batched transfer of PRKV Sec. 4.2 (accelerators)
        self.offload = ("direct" if self.device.type == "cpu" else "pool") if offload == "auto" else offload
        self.direct = self.offload == "direct"
        if op_threads is not None and (isinstance(op_threads, bool) or not isinstance(op_threads, int)
                                       or op_threads < 0):
            raise InputError(f"op_threads must be an integer >= 0 (0: all threads), got {op_threads!r}")
        self.op_threads = op_threads or None  # intra-op threads for the decoder's own ops (None: all)
        self.working_set = False  # direct mode: attend over an in-place updated working set (False: gather)
        if not isinstance(window_in_budget, bool):
            raise InputError(f"window_in_budget must be true or false, got {window_in_budget!r}")
        self.sinks, self.window = policy.fixed_tokens(page_size)
        self.window_in_budget = window_in_budget
        self.cap = attended_cap(kv_budget, self.window, window_in_budget)  # most tokens a step attends
        if not policy.select_all():
            check_budget(self.cap, page_size, self.sinks, self.window, kv_budget)
        self.device_pages = device_pages or 2 * pages_for(self.cap, page_size)
        self.scaling = scaling if scaling is not None else head_dim ** -0.5
        self.layers: list[_LayerState | None] = [None] * num_layers
        self.transfer = BatchedTransfer(self.device)
        self.recall = RecallMeter(num_layers)
        self.diagnostic = False
        self.step = 0
        self._clock = 0  # one tick per attend: the device pools' LRU stamp
        self._attends = 0
        self._selected_tokens = 0
        self._refresh_bytes = 0
        self._pages_read = 0
        self._heads = torch.arange(num_kv_heads, device=self.device).unsqueeze(1)  # [Hkv, 1]
        self._ranges: dict[tuple[int, int], torch.Tensor] = {}
        self._gather_buf: torch.Tensor | None = None
        self.reserve_tokens = 256  # room for decoded tokens in the host pools (a server sets max_new_tokens)
        self._context_tokens = 0  # tokens a dense step would attend, summed over attends (selected fraction)

    # ----------------------------------------------------------------------------------- prefill
    def check_prefill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int]:
        """``[Hkv, n, D]`` prefill K/V of this decoder's shape -> (Hkv, n, D); else an `InputError`."""
        Hkv, n, D = keys.shape
        if (Hkv, D) != (self.num_kv_heads, self.head_dim) or values.shape != keys.shape:
            raise InputError(f"layer {layer}: prefill K/V {tuple(keys.shape)} / {tuple(values.shape)} do not match "
                             f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}")
        return Hkv, n, D

    def load_prefill(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                     obs_queries: torch.Tensor | None = None, sliding_window: int | None = None,
                     scaling: float | None = None, inv_freq: torch.Tensor | None = None) -> None:
        """Take a layer's prefill K/V ``[Hkv, n, D]`` (post-RoPE) and the observation queries ``[Hq, w, D]``
        of the last ``w`` prompt tokens (needed by static policies: `snapkv`, `prkv`; the last ``window``
        of them are used: the observation window is the local window). ``scaling`` (the model's attention
        scaling, default ``head_dim ** -0.5``) is used for the observation scores. ``inv_freq`` (the layer's
        RoPE frequencies) is only used by decoders that un-rotate keys (`shadowkv`)."""
        if scaling is not None:
            self.scaling = scaling
        Hkv, n, D = self.check_prefill(layer, keys, values)
        keys, values = keys.to(self.device, self.dtype), values.to(self.device, self.dtype)
        host = HostPool(Hkv, self.page_size, D, self.dtype, capacity_tokens=n + self.reserve_tokens)
        slots = pages_for(sliding_window, self.page_size) + 1 if sliding_window else self.device_pages
        pool = None if self.direct else DevicePool(Hkv, self.page_size, D, self.dtype, self.device, slots)
        bounds = PageBounds(Hkv, self.page_size, D, self.device, getattr(self.policy, "digest", "box"))
        st = _LayerState(host, pool, bounds, sliding_window, front=pages_for(self.sinks, self.page_size))
        host.load(keys, values)
        st.bounds.reserve(pages_for(n + self.reserve_tokens, self.page_size))
        st.bounds.rebuild(keys)
        if self.direct and sliding_window is None and self.working_set:
            st.ws = WorkingSet(host, self.device)
        self.layers[layer] = st
        if self.policy.static and sliding_window is None:
            if obs_queries is None or obs_queries.shape[1] == 0:
                raise InputError(f"policy {self.policy.name!r} needs the observation-window queries at prefill")
            # the observation tokens must lie in the local window, which restructuring never moves
            st.obs_q = obs_queries[:, -self.window:].to(self.device, copy=True)
            ratio = self.policy.static_ratio
            st.static_ratio = None if ratio == "auto" else float(ratio)
            self._select_static(st, keys)

    # ------------------------------------------------------------------------------ static set
    def _select_static(self, st: _LayerState, keys: torch.Tensor) -> None:
        """PRKV Alg. 1: score [0, R) with the observation queries, move sinks + top tokens to the front
        pages, rebuild those pages' boxes, drop stale device copies. R = local-window page start."""
        P, host = self.page_size, st.host
        n = host.n_tokens
        R = (max(0, n - self.window) // P) * P
        probs = observation_probs(st.obs_q, keys, self.scaling)  # [Hq, w, n]
        if st.static_ratio is None:  # "auto": chosen once, at prefill (App. G)
            st.static_ratio = online_static_ratio(probs[..., :R], self.kv_budget, P)
        n_static = min(front_pages(self.kv_budget, P, self.sinks, self.window, st.static_ratio, self.cap),
                       R // P) * P
        st.front = max(n_static // P, pages_for(self.sinks, P))  # sinks stay first in any storage order
        st.ranked = None  # pages moved: rank again
        st.static_steps.append(self.step)
        if n_static == 0:
            return
        pos = host.token_pos[:, :R]
        scores = pool_in_token_order(group_mean(probs[..., :R], self.num_kv_heads), pos, self.policy.kernel_size)
        perm = static_permutation(scores, pos, n_static, self.sinks)
        new_keys = keys[:, :R].gather(1, perm.unsqueeze(-1).expand(-1, -1, self.head_dim))
        perm = perm.cpu()
        new_values = host.rows(V, R).gather(1, perm.unsqueeze(-1).expand(-1, -1, self.head_dim))
        new_pos = pos.gather(1, perm)
        stale = (new_pos != pos).view(self.num_kv_heads, R // P, P).any(dim=-1)
        host.write_prefix(new_keys, new_values, new_pos)
        st.bounds.rebuild(new_keys)
        if st.device is not None:
            st.device.invalidate(stale)
        if st.ws is not None:
            st.ws.clear()

    # ---------------------------------------------------------------------------------- decode
    def _layer(self, layer: int) -> _LayerState:
        st = self.layers[layer]
        if st is None:
            raise InputError(f"layer {layer} has no prefill: call load_prefill first")
        return st

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the new token's K/V ``[Hkv, 1, D]`` (post-RoPE) to the layer's cache."""
        with self._op_threads():
            self._append(layer, k, v)

    def attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``q [Hq, 1, D]`` over the selected tokens of the layer -> ``[Hq, 1, D]``."""
        with self._op_threads():
            return self._attend(layer, q, scaling)

    @contextlib.contextmanager
    def _op_threads(self):
        """Run the decoder's per-layer ops on at most ``op_threads`` intra-op threads (CPU). A sparse step
        is a few dozen small ops per layer; forking the thread pool for each costs more than it saves
        (and far more on a loaded machine), while the model's own matmuls keep every thread."""
        cap, have = self.op_threads, torch.get_num_threads()
        if not cap or have <= cap or self.device.type != "cpu":
            yield
            return
        torch.set_num_threads(cap)
        try:
            yield
        finally:
            torch.set_num_threads(have)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        st = self._layer(layer)
        page, offset = st.host.append(k, v)
        st.bounds.add_token(page, offset, k)
        if st.ws is not None:
            st.ws.touch(page)
        if st.device is not None:
            st.device.write_token(page, offset, k, v)

    def begin_step(self, layer: int, q: torch.Tensor, scaling: float):
        """This layer's state and this step's page plan, the observation window updated with ``q`` (what the
        lone attend and the batched one both do first) -> (state, plan)."""
        st = self._layer(layer)
        self.scaling = scaling
        if st.obs_q is not None:
            self._observe(st, q)
        return st, plan_step(st.host.n_tokens, self.page_size, self.cap, st.front, self.window,
                             select_all=self.policy.select_all(), sliding_window=st.sliding_window)

    def _attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        st, plan = self.begin_step(layer, q, scaling)
        if self.direct and st.ws is None and paged_kernel.kernel_ok(self.dtype, self.device):
            out = self._select_attend(layer, st, plan, q, scaling)
            if out is not None:
                return out
        st.selected = self._select_pages(st, plan, q)
        if st.ws is not None:  # CPU: attend over the working set, updated in place (no per-step gather)
            ws = st.ws
            ws.update(st.selected)
            self._pages_read += ws.slot_page.numel()
            out = biased_attention(q, ws.keys, ws.values, scaling, ws.bias)
            self._count(plan)
            if self.diagnostic:
                self._record_recall(layer, st, plan, q, scaling, out, ws.tokens(), ws.bias == 0)
            return out
        if self.direct and paged_kernel.kernel_ok(self.dtype, self.device):  # CPU float32: read in place
            self._pages_read += st.selected.numel()
            out = paged_kernel.attend_row(q, st.host.data, st.selected, plan.n_tokens, plan.lo, scaling).to(q.dtype)
            self._count(plan)
            if self.diagnostic:
                tokens = self._tokens(st.selected)
                self._record_recall(layer, st, plan, q, scaling, out, tokens,
                                    (tokens >= plan.lo) & (tokens < plan.n_tokens))
            return out
        keys, values = self._gather(st, st.selected)
        if plan.lo == 0:  # the last page (always selected, last in the table) is the only partial one
            end = keys.shape[1] - (plan.n_pages * self.page_size - plan.n_tokens)
            keys, values, valid = keys[:, :end], values[:, :end], None
        else:  # sliding-window layer: mask the tokens before the window
            tokens = self._tokens(st.selected)
            valid = (tokens >= plan.lo) & (tokens < plan.n_tokens)
        out, _ = grouped_attention(q, keys, values, scaling, valid)
        self._count(plan)
        if self.diagnostic:
            tokens = self._tokens(st.selected)[:, : keys.shape[1]]
            if valid is None:
                valid = torch.ones_like(tokens, dtype=torch.bool)
            self._record_recall(layer, st, plan, q, scaling, out, tokens, valid)
        return out

    def _select_attend(self, layer: int, st: _LayerState, plan: PagePlan, q: torch.Tensor,
                       scaling: float) -> torch.Tensor | None:
        """CPU float32, read in place: the page table and the attention in one kernel call (`_select_pages` and
        `paged_kernel.attend_row` in one, the same pages and outputs); None when the policy's ranking has no
        kernel form (e.g. ArkVale's shared groups), for the separate path."""
        reused = None
        if 0 < plan.n_dynamic < plan.n_candidates:
            reused = self.reused_pages(st, plan)
            if reused is None and not rank_kernel.rank_ok(self.policy, self.device):
                return None
        st.selected, ranked, out = paged_kernel.select_attend_row(q, st.host.data, st.bounds, plan, self.policy,
                                                                  reused, scaling)
        if ranked is not None:
            self.remember_ranking(st, plan, ranked)
        self._pages_read += st.selected.numel()
        self._count(plan)
        out = out.to(q.dtype)
        if self.diagnostic:
            tokens = self._tokens(st.selected)
            self._record_recall(layer, st, plan, q, scaling, out, tokens,
                                (tokens >= plan.lo) & (tokens < plan.n_tokens))
        return out

    def _count(self, plan: PagePlan) -> None:
        self._attends += 1
        self._selected_tokens += plan.selected_tokens
        self._context_tokens += plan.n_tokens - plan.lo

    def _tokens(self, pages: torch.Tensor) -> torch.Tensor:
        """Storage index of every row of a gathered page table ``[Hkv, M]`` -> ``[Hkv, M*P]``."""
        P = self.page_size
        return (pages.to(self.device).unsqueeze(-1) * P + torch.arange(P, device=self.device)).flatten(1)

    def _range(self, start: int, end: int) -> torch.Tensor:
        """``arange(start, end)`` for every KV head ``[Hkv, end - start]`` (cached: a decode step reuses them)."""
        r = self._ranges.get((start, end))
        if r is None:
            if len(self._ranges) > 256:
                self._ranges.clear()
            r = self._ranges[(start, end)] = torch.arange(start, end).expand(self.num_kv_heads, -1)
        return r

    def _observe(self, st: _LayerState, q: torch.Tensor) -> None:
        """Slide the observation window over the new query; re-select the static set every T steps."""
        st.obs_q[:, st.obs_head] = q[:, 0]  # overwrite the oldest (a ring: no per-step copy of the window)
        st.obs_head = (st.obs_head + 1) % st.obs_q.shape[1]
        if self.step > 0 and self.step % self.policy.refresh_interval == 0 and st.static_steps[-1] != self.step:
            if st.obs_head:  # back to time order (the causal mask among the window queries needs it)
                st.obs_q, st.obs_head = torch.roll(st.obs_q, -st.obs_head, dims=1), 0
            keys = st.host.rows(K).to(self.device)  # re-scoring reads every key (amortized over T)
            self._refresh_bytes += keys.numel() * keys.element_size()
            self._select_static(st, keys)

    def _gather(self, st: _LayerState, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[Hkv, M*P, D]`` of ``pages [Hkv, M]`` (row h read for KV head h).

        ``pool``: make the pages resident (one batched transfer of the misses, Sec. 4.2) and read them
        from the device pool. ``direct`` (CPU): host and device memory are one, so the pages are read
        straight from the host pool, one index_select per K / V (no staging, no pool bookkeeping).
        """
        H, M = pages.shape
        P, D = self.page_size, self.head_dim
        if self.direct:
            index = (pages * H + self._heads).flatten()
            self._pages_read += H * M
            buf = self._gather_buf  # reused across layers and steps: a fresh ~1 MB output per call would be
            if buf is None or buf.shape[1] < H * M or buf.dtype != st.host.dtype:  # an mmap + page faults
                buf = self._gather_buf = torch.empty(2, H * M, P, D, dtype=st.host.dtype)
            keys, values = buf[0, : H * M], buf[1, : H * M]
            torch.index_select(st.host.flat(K), 0, index, out=keys)
            torch.index_select(st.host.flat(V), 0, index, out=values)
            return keys.view(H, M * P, D), values.view(H, M * P, D)
        self._clock += 1
        slots = st.device.fetch(pages, st.host, self.transfer, self._clock)
        self._pages_read += H * M
        return st.device.gather(slots, K), st.device.gather(slots, V)

    def _select_pages(self, st: _LayerState, plan: PagePlan, q: torch.Tensor) -> torch.Tensor:
        """Page table ``[Hkv, M]`` (CPU): front pages, the dynamic pages of each KV head, local pages."""
        H = self.num_kv_heads
        front = self._range(0, plan.front)
        local = self._range(plan.local_start, plan.n_pages)
        if plan.n_dynamic == plan.n_candidates:
            return self._range(0, plan.n_pages)  # everything (front, candidates, local are contiguous)
        if plan.n_dynamic == 0:
            return torch.cat([front, local], dim=1)
        dynamic = self.reused_pages(st, plan)
        if dynamic is None:
            q = q.to(self.device).view(H, -1, self.head_dim)
            if rank_kernel.rank_ok(self.policy, self.device):  # CPU: scores and top-k in one numba call
                dynamic = rank_kernel.top_pages(self.policy, q, st.bounds, plan.front, plan.local_start,
                                                 plan.n_dynamic, self.scaling)
            else:
                box = st.bounds.digests(plan.front, plan.local_start)
                scores = self.policy.box_scores(q, box, plan.front, self.scaling)
                dynamic = scores.topk(plan.n_dynamic, dim=1).indices + plan.front
            self.remember_ranking(st, plan, dynamic)
        return torch.cat([front, dynamic.cpu(), local], dim=1)

    def reused_pages(self, st: _LayerState, plan: PagePlan) -> torch.Tensor | None:
        """The last ranking's dynamic pages while ``rerank_interval`` says they serve (same front and count, no
        restructure since: candidates only grow as pages leave the window), else None: rank now."""
        r, interval = st.ranked, getattr(self.policy, "rerank_interval", 1)
        fresh = r is not None and self.step - r[0] < interval and (r[1], r[2]) == (plan.front, plan.n_dynamic)
        return r[3] if fresh else None

    def remember_ranking(self, st: _LayerState, plan: PagePlan, dynamic: torch.Tensor) -> None:
        reranks = getattr(self.policy, "rerank_interval", 1) > 1
        st.ranked = (self.step, plan.front, plan.n_dynamic, dynamic) if reranks else None

    def _record_recall(self, layer, st, plan, q, scaling, out, tokens, valid) -> None:
        """Diagnostic mode: dense attention over the whole (windowed) cache, recall of the selection."""
        n = plan.n_tokens
        dense_valid = (torch.arange(n, device=self.device) >= plan.lo).expand(self.num_kv_heads, n)
        dense_out, dense_probs = grouped_attention(q, st.host.rows(K).to(self.device),
                                                   st.host.rows(V).to(self.device), scaling, dense_valid)
        self.recall.record(layer, attention_recall(dense_probs, tokens, valid),
                           oracle_recall(dense_probs, plan.selected_tokens),
                           (out.float() - dense_out.float()).abs().max().item(),
                           oracle_recall(dense_probs, plan.selected_tokens, shared=True))

    def end_step(self) -> None:
        """Once per generated token, after every layer attended: advances the refresh counter."""
        self.step += 1


def make_decoder(policy: str | DecodePolicy = "prkv", kv_budget: int | None = None, *, num_layers: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 32, device="cpu",
                 dtype: torch.dtype = torch.float32, device_pages: int | None = None,
                 scaling: float | None = None, window_in_budget: bool = False, offload: str = "auto",
                 op_threads: int | None = 1, **policy_kwargs) -> SparseDecoder:
    """A `SparseDecoder` for a policy: a registered name, a spec string (``"prkv(static_ratio=0.5)"``) or a
    policy object (`make_policy`); ``policy_kwargs`` are the policy's fields, e.g. ``static_ratio``,
    ``refresh_interval``, ``window``, ``sinks``. ``kv_budget``: the policy's own if it has one, else this, else
    1024 (`policy_budget`: both given and different is an error).

    ``page_size``: 32 (PRKV Sec. 5.1, for Quest / ArkVale / PRKV alike). ``device_pages``: device-pool slots
    per layer and KV head (default twice the step's pages; grows when a step needs more, e.g. for
    ``dense``). ``window_in_budget``: count the local window inside ``kv_budget`` (default: on top, as the
    paper counts ``k``). ``offload``: ``"pool"`` (device pool + batched transfer), ``"direct"`` (read the
    host pool in place: CPU only) or ``"auto"`` (direct on CPU, pool elsewhere). ``op_threads``: intra-op
    threads for the decoder's own per-layer ops (default 1, see `SparseDecoder._op_threads`; 0 = all).
    A policy with its own decoder (``shadowkv``) gets that class.
    """
    pol = make_policy(policy, **policy_kwargs)
    cls = getattr(pol, "decoder_class", None) or SparseDecoder
    return cls(pol, policy_budget(pol, kv_budget), num_layers, num_q_heads, num_kv_heads, head_dim, page_size, device, dtype,
               device_pages, scaling, window_in_budget, offload, op_threads)
