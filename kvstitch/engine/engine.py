"""`Engine`: load a model, precompute/stitch chunk caches, recompute a budget of tokens, decode."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import platform
import time
from dataclasses import dataclass, field

import torch

from kvstitch.core.attention import ForwardPlan, StopForward
from .batch import DecodeStep, RecomputeStep, can_batch, decode_batch, recompute_batch
from kvstitch.core.cache import StitchCache
from .cold import DEFAULT_COLD_THRESHOLD, DeferredPrecompute, check_cold_path, precompute_deferred, take_full_prefill
from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import InputError, PromptTooLong, UnknownDecodePolicy
from kvstitch.core.identity import register_model, tokenizer_fingerprint
from kvstitch.models import adapter_for, cache_kwargs, load_model
from kvstitch.models.half_cpu import multiplies_natively
from kvstitch.core.anchors import AnchorSpec
from .precompute import PrecomputeReport, ensure_chunks, precompute_texts
from kvstitch.core.prompt import PromptBuilder, PromptLayout
from kvstitch.core.rope import inv_freq_table, rerotate, self_check
from kvstitch.select import SelectionContext, Selector, make_selector
from kvstitch.store import ChunkStore, check_precompute, chunk_key, open_store
from .budget import AUTO, AutoBudget, adaptive_prefill, parse_ratio
from .stats import GenerationStats

log = logging.getLogger("kvstitch.engine")
DEFAULT_METHOD = "prophet"
_DTYPES = ("float32", "bfloat16", "float16")  # model dtypes Engine.load accepts by name
STOP = object()  # `stream(...).send(STOP)`: end the generation after the token just yielded (stop sequences)


@dataclass
class GenerationResult:
    text: str
    ttft_s: float
    recomputed: list[int]  # context-token indices (0-based within the context) that were recomputed
    stats: GenerationStats  # what the engine measured (fields documented there; ``to_dict()`` for JSON)
    token_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None  # logits of the first answer token (float32, cpu)
    method: str = ""


@dataclass
class GenerationRequest:
    """One request, as `Engine.generate` / `Engine.stream` take it (their parameters are these fields)."""

    question: str | None = None
    chunks: list[str] | None = None  # the passages, each precomputed and stored on its own
    messages: list[dict] | None = None  # an OpenAI-style conversation instead of ``question``
    # a method object (``DeltaProp(base=InfoFlow())``) or its spec string ("deltaprop(base=infoflow)"), see
    # `kvstitch.select`
    method: str | Selector = DEFAULT_METHOD
    # the fraction of the context tokens to recompute, or "auto": rounds of growing budget until the answer is
    # stable (options in ``auto``, see `kvstitch.engine.budget`)
    recompute_ratio: float | str = 0.2
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # of the sampling (temperature > 0)
    # "full" (dense attention) or a sparse policy (prkv, quest, snapkv, arkvale, ...) over ``kv_budget`` tokens
    decode: str = "full"
    kv_budget: int | None = None
    auto: AutoBudget | dict | None = None  # options of recompute_ratio="auto" (None: the engine's default_auto)
    # "full": verify the greedy answer against full prefill (full prefill's answer is returned when they differ)
    guard: str | None = None
    method_options: dict | None = None  # options merged into ``method`` (kept for callers that name it)
    # of the sparse decoder: ``diagnostic=True`` records attention recall (``stats.decode_recall``);
    # ``page_size``, ``device_pages`` and the policy's fields go to `kvstitch.decode.make_decoder`
    decode_options: dict | None = None
    min_new_tokens: int = 0  # EOS is masked until the answer has this many tokens (vLLM's min_tokens; benches)
    layout: PromptLayout | None = None  # a prompt laid out already (`Engine.layout`) instead of question + chunks


@dataclass
class Prefill:
    """A prefilled request, ready to decode: everything per-request lives here (the engine is reentrant)."""

    cache: StitchCache  # with room for the answer
    layout: PromptLayout  # the layout used (a selector may have reordered the chunks)
    logits: torch.Tensor  # [q, V] suffix logits of the last pass; row -1 predicts the first answer token
    indices: torch.Tensor  # context indices whose K/V were recomputed
    stats: dict
    selector: object  # the method's `Selector` (its decode plan applies after the first token)
    greedy: list[int] = field(default_factory=list)  # answer tokens an adaptive prefill already computed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fast_dtype(device: torch.device | None = None) -> str:
    """The quicker model dtype on ``device``: bfloat16 where it multiplies bf16 natively (CUDA with bf16 support;
    a CPU with AVX512-BF16 or AMX: on this project's CPU, 1.8x faster Qwen prefill than float32), else float32.
    `Engine.load`'s default stays float32 on CPU (the exactness gates and the published runs use it); the demo
    takes this one (``dtype="fast"``)."""
    dev = device or default_device()
    return "bfloat16" if multiplies_natively(torch.bfloat16, dev) else "float32"


@functools.cache  # one machine per process
def cpu_name() -> str:
    """This machine's CPU model ("AMD EPYC", "Intel(R) Xeon(R) ..."): eval rows carry it, since a run resumed on
    another machine times its samples there (TTFT ratios pool them)."""
    with contextlib.suppress(OSError):  # no /proc (macOS, Windows): platform's name
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


class Engine:
    def __init__(self, model, tokenizer, weights_id: str, store: ChunkStore | None = None,
                 check_rope: bool = True, precompute: str = "shared_prefix", cold_path: str = "auto",
                 cold_threshold: float = DEFAULT_COLD_THRESHOLD):
        """``precompute``: how chunk caches are computed - "shared_prefix" (after the shared prefix, the one
        attention sink) or "isolated" (each chunk from position 0 on its own, as A3 / InfoFlow do); part of
        the chunk store key. ``cold_path`` / ``cold_threshold``: what a request whose chunks are missing from
        the store does ("auto": full prefill when more than the threshold of its context is missing, the
        chunks precomputed off the request path; see `kvstitch.engine.cold`)."""
        self.precompute_mode = check_precompute(precompute)
        self.cold_path, self.cold_threshold = check_cold_path(cold_path, cold_threshold)
        self.deferred = DeferredPrecompute()
        self.default_auto: AutoBudget | dict | None = None  # options of ratio "auto" for requests that give none
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter_for(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.builder = PromptBuilder(tokenizer)
        self.store = store if store is not None else open_store(None, compute_dtype=self.dtype)
        self.inv_freq = inv_freq_table(self.adapter).to(self.device)
        self.weights_id = weights_id
        self.fingerprint = self._fingerprint(weights_id)
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        register_model(self)
        if getattr(self.store, "fingerprint", None) is None and hasattr(self.store, "fingerprint"):
            self.store.fingerprint = self.fingerprint  # entries of another model are reported, never used
        self._prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.eos_ids = self._eos_ids()
        self.rope_error = self_check(model, self.adapter, self._probe_ids()) if check_rope else None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, store=None, device: str | None = None,
             dtype: str | torch.dtype | None = None, storage_dtype: str = "float16", **kwargs) -> "Engine":
        """``model``: None (embedded SmolLM2-135M-Instruct), "gemma3", "qwen2.5-0.5b" (the reference model), "qwen2.5-1.5b", an HF
        directory or a .gguf file.
        ``store``: None (in-memory), a directory path, "redis://host:port/db" or "tiered:A,B"; chunk K/V
        are kept in ``storage_dtype`` (float16, bfloat16, float32 or int8).
        ``dtype``: the model's; default float32 on CPU, bfloat16 on CUDA; "fast" = `fast_dtype` of the device."""
        dev = torch.device(device) if device else default_device()
        if dtype is None:
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        elif dtype == "fast":  # bfloat16 where the device multiplies it natively, else float32
            dtype = getattr(torch, fast_dtype(dev))
        elif isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise InputError(f"unknown dtype {dtype!r}: use one of {', '.join(_DTYPES)} or fast")
            dtype = getattr(torch, dtype)
        if dev.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not multiplies_natively(dtype, dev):
            # emulated half precision (kvstitch.models.half_cpu): same numbers, float32's speed, half the weights
            log.info("%s on this CPU (%s) is emulated, not native (no AVX512-BF16/AMX): linear layers multiply in "
                     "float32 and round to %s, at about float32's speed", str(dtype).removeprefix("torch."),
                     cpu_name(), str(dtype).removeprefix("torch."))
        store_ = open_store(store, storage_dtype=storage_dtype, compute_dtype=dtype)  # fail fast: before the model
        check_precompute(kwargs.get("precompute", "shared_prefix"))
        model_, tok, weights_id = load_model(model, dev, dtype)
        return cls(model_, tok, weights_id, store=store_, **kwargs)

    def _fingerprint(self, weights_id: str) -> str:
        ad = self.adapter
        desc = {"weights": weights_id, "dtype": str(self.dtype), "family": ad.family,
                "rope": [ad.rope_parameters(i) for i in range(ad.num_layers)],
                "layers": ad.num_layers, "kv_heads": ad.num_kv_heads, "head_dim": ad.head_dim}
        return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return ids

    def _probe_ids(self) -> torch.Tensor:
        ids = self.tokenizer.encode("The quick brown fox jumps over the lazy dog near the river bank.",
                                    add_special_tokens=False)
        return torch.tensor(ids[:16], dtype=torch.long)

    # ---- low-level forward ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, cache: StitchCache, ids: torch.Tensor, slots: torch.Tensor, plan: ForwardPlan | None = None,
                logits_to_keep: int = 1, write: bool = True,
                positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run ``ids`` at global positions ``slots`` (sorted) over ``cache``; returns the last logits.
        Returns None when the plan stopped the pass early (scoring passes). ``positions``: RoPE positions
        other than the slots (a compacted cache whose slots are not positions: QCFuse's anchor probe)."""
        plan = plan or ForwardPlan()
        slots = slots.to(self.device)
        plan.q_slots = slots
        pos = slots if positions is None else positions.to(self.device)
        with cache.mode(slots=slots, write=write):
            try:
                ids = ids.view(1, -1) if ids.dim() == 1 else ids
                out = self.model(input_ids=ids.to(self.device),
                                 position_ids=pos.view(1, -1).expand(ids.shape[0], -1),
                                 **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=logits_to_keep,
                                 kvstitch_plan=plan)
                return out.logits[0].float() if ids.shape[0] == 1 else out.logits.float()
            except StopForward:
                return None

    # ---- precompute -----------------------------------------------------------------------------
    def prefix_kv(self, prefix_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the shared prefix (cached: identical for every request)."""
        if self._prefix is None or not torch.equal(self._prefix[0], prefix_ids):
            n = prefix_ids.numel()
            cache = StitchCache.empty(self.adapter, n, self.device, self.dtype)
            self.forward(cache, prefix_ids, torch.arange(n))
            self._prefix = (prefix_ids.clone(), cache.stacked_keys(), cache.stacked_values())
        return self._prefix[1], self._prefix[2]

    def compute_chunk(self, prefix_ids: torch.Tensor, chunk_ids: torch.Tensor) -> ChunkKV:
        """One chunk's K/V with the shared prefix as its only context (the attention sink)."""
        return self.compute_chunks(prefix_ids, [chunk_ids])[0]

    def compute_chunks(self, prefix_ids: torch.Tensor, chunks: list[torch.Tensor], batch_size: int = 8) -> list[ChunkKV]:
        """Precompute several chunks, ``batch_size`` per forward. Chunks of a batch are right-padded to
        one length; causal masks keep every real token blind to the padding after it. In ``isolated``
        precompute mode a chunk runs alone from position 0 (no prefix; ``ChunkKV.start`` = 0)."""
        pk, pv = self.prefix_kv(prefix_ids)
        p = prefix_ids.numel()
        if self.precompute_mode == "isolated":
            pk, pv, p = pk[:, :, :0], pv[:, :, :0], 0
        out: list[ChunkKV] = []
        for b0 in range(0, len(chunks), batch_size):
            batch = chunks[b0:b0 + batch_size]
            n = max(c.numel() for c in batch)
            ids = torch.full((len(batch), n), int(batch[0][0]), dtype=torch.long)
            for i, c in enumerate(batch):
                ids[i, :c.numel()] = c
            cache = StitchCache.from_stacked(pk, pv, capacity=p + n, batch=len(batch))
            self.forward(cache, ids, torch.arange(p, p + n))
            keys, values = cache.stacked_keys(p, p + n, batch=True), cache.stacked_values(p, p + n, batch=True)
            for i, c in enumerate(batch):
                m = c.numel()
                out.append(ChunkKV(keys[i, :, :, :m].clone(), values[i, :, :, :m].clone(), c.clone().cpu(), p,
                                   self.fingerprint))
        return out

    def chunk_key(self, prefix_ids: torch.Tensor, chunk_ids: torch.Tensor) -> str:
        return chunk_key(self.fingerprint, prefix_ids, chunk_ids, getattr(self.store, "storage_dtype", "native"),
                         precompute=self.precompute_mode, tokenizer=self.tokenizer_id)

    def chunk_kvs(self, layout: PromptLayout, stats: dict | None = None, anchors=None) -> list[ChunkKV]:
        """Look every chunk up in the store; precompute the misses (batched) and write them back. ``anchors``
        (an `AnchorSpec`, what `qcfuse` needs): every chunk carries its anchor scores too (`kvstitch.core.anchors`)."""
        t0 = time.perf_counter()
        res = ensure_chunks(self, layout.chunk_ids, prefix_ids=layout.prefix_ids, load=True, anchors=anchors)
        if stats is not None:
            stats.update(store_hits=res.hits, store_misses=res.misses, chunk_load_s=time.perf_counter() - t0,
                         precompute=self.precompute_mode)
            if anchors is not None:
                stats.update(anchors_added=res.anchored, anchor_s=res.anchor_s)
        return [kv.to(self.device, self.dtype) for kv in res.kvs]

    def precompute(self, texts: list[str], chunk_tokens: int | None = None, overlap: int = 0, batch_size: int = 8,
                   progress: bool = True, anchors=None) -> PrecomputeReport:
        """Cache passages before the questions come, so the first question is a warm hit (the cold path
        would answer it by full prefill). ``texts``: the passages as ``generate(chunks=...)`` will get them
        (``chunk_tokens`` None), or documents to split into chunks of ~``chunk_tokens`` tokens. Chunks already
        stored are skipped; a progress bar shows tok/s. ``anchors``: True (QCFuse's default pass) or an
        `AnchorSpec`: each chunk also stores its anchor scores (what `qcfuse` reads; stored chunks without
        them get them added). -> report: chunks, computed, skipped, tokens, seconds."""
        if chunk_tokens is not None and chunk_tokens < 1:
            raise InputError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if anchors is True:
            anchors = AnchorSpec()
        elif anchors is not None and not isinstance(anchors, AnchorSpec):
            raise InputError(f"anchors must be True, None or an AnchorSpec, got {anchors!r:.60}")
        return precompute_texts(self, texts, chunk_tokens, overlap, batch_size, progress, anchors or None)

    def precompute_deferred(self, max_chunks: int | None = None) -> int:
        """Compute and store the chunks cold requests answered by full prefill left behind (`kvstitch.engine.cold`);
        up to ``max_chunks`` of them -> how many were handled. Call it off the request path."""
        return precompute_deferred(self, max_chunks)

    # ---- stitching ------------------------------------------------------------------------------
    def stitch(self, layout: PromptLayout, chunks: list[ChunkKV], extra: int = 0) -> StitchCache:
        """Prefix K/V + every chunk's K/V, keys re-rotated from precompute to global positions."""
        pk, pv = self.prefix_kv(layout.prefix_ids)
        cache = StitchCache.from_stacked(pk, pv, capacity=layout.n_total + extra)
        for start, kv in zip(layout.chunk_starts, chunks):
            keys = rerotate(kv.keys, start - kv.start, self.inv_freq)
            n = kv.n_tokens
            for i, layer in enumerate(cache.layers):
                layer.keys[0, :, start:start + n] = keys[i]
                layer.values[0, :, start:start + n] = kv.values[i]
        for layer in cache.layers:
            layer.length = layout.context_end
        return cache

    # ---- recompute ------------------------------------------------------------------------------
    def recompute(self, cache: StitchCache, layout: PromptLayout, indices: torch.Tensor,
                  plan: ForwardPlan | None = None, logits_to_keep: int = 1) -> torch.Tensor:
        """One pass of the selected context tokens plus the suffix, at their global positions, through
        all layers; their fresh K/V overwrite the stitched cache. Returns the suffix's last logits."""
        step = self.recompute_step(cache, layout, indices, plan)
        return self.forward(cache, step.ids, step.slots, plan, logits_to_keep=logits_to_keep)

    def recompute_step(self, cache: StitchCache, layout: PromptLayout, indices: torch.Tensor,
                       plan: ForwardPlan | None = None) -> RecomputeStep:
        """The pass `recompute` runs, as a `RecomputeStep` (for `recompute_batch`)."""
        slots = torch.cat([indices.to(torch.long).cpu() + layout.context_start,
                           torch.arange(layout.context_end, layout.n_total)])
        return RecomputeStep(cache, layout.ids[slots], slots, plan)

    @torch.no_grad()
    def recompute_batch(self, steps: list[RecomputeStep]) -> list[torch.Tensor]:
        """Run the recompute passes of several requests as one packed forward (`kvstitch.engine.batch`) -> each
        pass's last logits ``[1, V]``, in order, as if it ran alone (one step: the lone path)."""
        return recompute_batch(self, steps)

    def _pass_steps(self, step: RecomputeStep, batch: bool):
        """Run ``step`` here, or (``batch`` and a plain pass) yield it and take its logits from the consumer."""
        if not (batch and can_batch(step)):
            t0 = time.perf_counter()
            logits = self.forward(step.cache, step.ids, step.slots, step.plan)
            step.seconds, step.batch_size = time.perf_counter() - t0, 1
            return logits
        logits = yield step
        if logits is None:
            raise InputError("a batched recompute pass needs its logits sent back (Engine.recompute_batch)")
        return logits

    def _full_prefill_steps(self, layout: PromptLayout, extra: int, batch: bool, stats: dict):
        """`full_prefill` (lone), or as a `RecomputeStep` when ``batch``: the whole prompt over an empty cache."""
        if not batch:
            t0 = time.perf_counter()
            cache, logits = self.full_prefill(layout, extra=extra)
            stats.update(recompute_s=time.perf_counter() - t0, ratio_used=1.0)
            return cache, logits
        cache = StitchCache.empty(self.adapter, layout.n_total + extra, self.device, self.dtype)
        step = RecomputeStep(cache, layout.ids, torch.arange(layout.n_total))
        logits = yield from self._pass_steps(step, batch)
        stats.update(recompute_s=step.seconds, ratio_used=1.0, recompute_batch=step.batch_size)
        return cache, logits

    def full_prefill(self, layout: PromptLayout, extra: int = 0, plan: ForwardPlan | None = None,
                     logits_to_keep: int = 1) -> tuple[StitchCache, torch.Tensor]:
        cache = StitchCache.empty(self.adapter, layout.n_total + extra, self.device, self.dtype)
        logits = self.forward(cache, layout.ids, torch.arange(layout.n_total), plan, logits_to_keep)
        return cache, logits

    # ---- validation -----------------------------------------------------------------------------
    def layout(self, question: str | None, chunks: list[str] | None,
               messages: list[dict] | None = None) -> PromptLayout:
        if messages is not None:  # a conversation: see `PromptBuilder.build_messages`
            if question is not None:
                raise InputError("pass either a question or messages, not both")
            return self.builder.build_messages(messages, chunks)
        if question is None:
            raise InputError("pass a question or messages")
        if not isinstance(question, str) or not question.strip():
            raise InputError("the question is empty")
        if not chunks:
            raise InputError("no chunks given: pass at least one passage")
        for i, c in enumerate(chunks):
            if not isinstance(c, str) or not c.strip():
                raise InputError(f"chunk {i} is empty")
        return self.builder.build(question, chunks)

    def _check_request(self, layout: PromptLayout, ratio, max_new_tokens: int,
                       decode: str = "full", kv_budget: int | None = None,
                       decode_options: dict | None = None) -> float | str:
        """Validate a request (before anything is computed; its method is parsed before) -> the parsed ratio
        (a float or "auto")."""
        ratio = parse_ratio(ratio)
        from kvstitch.decode import DECODE_POLICIES

        if decode != "full" and decode not in DECODE_POLICIES:
            raise UnknownDecodePolicy(f"unknown decode policy {decode!r}; known: full, "
                                      f"{', '.join(sorted(DECODE_POLICIES))}")
        if kv_budget is not None and (not isinstance(kv_budget, int) or kv_budget < 1):
            raise InputError(f"kv_budget must be a positive integer, got {kv_budget!r}")
        if decode_options is not None and (decode == "full" or not isinstance(decode_options, dict)):
            raise InputError("decode_options (a dict) configure a sparse decoder; decode='full' (dense) takes none")
        if decode != "full":
            self.new_decoder(decode, kv_budget, decode_options)  # bad options / a too-small budget fail here
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        limit = self.adapter.max_positions
        if layout.n_total + max_new_tokens > limit:
            raise PromptTooLong(f"prompt is {layout.n_total} tokens + {max_new_tokens} new tokens > the model's "
                                f"limit of {limit} positions; pass fewer or shorter chunks (nothing is truncated)")
        return ratio

    # ---- the public entry points --------------------------------------------------------------
    @torch.no_grad()
    def generate(self, question: str | None = None, chunks: list[str] | None = None, *,
                 messages: list[dict] | None = None, method: str | Selector = DEFAULT_METHOD,
                 recompute_ratio: float | str = 0.2, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, decode: str = "full", kv_budget: int | None = None,
                 auto: AutoBudget | dict | None = None, guard: str | None = None,
                 method_options: dict | None = None, decode_options: dict | None = None, min_new_tokens: int = 0,
                 layout: PromptLayout | None = None) -> GenerationResult:
        """Answer ``question`` over ``chunks`` (or the conversation ``messages``); the parameters are
        `GenerationRequest`'s fields, documented there."""
        return self.run(GenerationRequest(
            question=question, chunks=chunks, messages=messages, method=method, recompute_ratio=recompute_ratio,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, decode=decode,
            kv_budget=kv_budget, auto=auto, guard=guard, method_options=method_options,
            decode_options=decode_options, min_new_tokens=min_new_tokens, layout=layout))

    @torch.no_grad()
    def run(self, request: GenerationRequest) -> GenerationResult:
        """`generate` for a `GenerationRequest`."""
        result = None
        for event in self.stream_request(request):
            if isinstance(event, GenerationResult):
                result = event
        return result

    @torch.no_grad()
    def stream(self, question: str | None = None, chunks: list[str] | None = None, *,
               messages: list[dict] | None = None, method: str | Selector = DEFAULT_METHOD,
               recompute_ratio: float | str = 0.2, max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, decode: str = "full", kv_budget: int | None = None,
               auto: AutoBudget | dict | None = None, guard: str | None = None,
               method_options: dict | None = None, decode_options: dict | None = None, min_new_tokens: int = 0,
               layout: PromptLayout | None = None):
        """`generate`, streamed: yield each answer token id (int) as it is produced, then the
        `GenerationResult` (see `stream_request`)."""
        yield from self.stream_request(GenerationRequest(
            question=question, chunks=chunks, messages=messages, method=method, recompute_ratio=recompute_ratio,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, decode=decode,
            kv_budget=kv_budget, auto=auto, guard=guard, method_options=method_options,
            decode_options=decode_options, min_new_tokens=min_new_tokens, layout=layout))

    @torch.no_grad()
    def stream_request(self, req: GenerationRequest):
        """Yield each generated token id (int) as it is produced, then the `GenerationResult`.

        Input errors are raised before anything is computed. A consumer that stops iterating stops the
        generation (servers use this when a client disconnects). With ``guard="full"`` the stitched answer is
        checked against full prefill before any token is yielded (see `verify_against_full`). The engine keeps
        no state of its own between requests: every per-request object lives in the `Prefill`. A consumer may
        ``send(STOP)`` instead of ``next()`` to end the generation after the token just yielded (stop
        sequences); the result then holds the tokens so far."""
        yield from self.steps(req)

    @torch.no_grad()
    def steps(self, req: GenerationRequest, *, batch_decode: bool = False, batch_prefill: bool = False):
        """`stream_request` for a batching consumer (the server's scheduler), which runs the model passes of
        several requests together. ``batch_prefill``: where the prefill's pass (recompute, or full prefill)
        would run, if it is plain (`kvstitch.engine.batch.can_batch`), a `RecomputeStep` is yielded instead and
        its logits are sent back (`recompute_batch` runs several). ``batch_decode``: every dense decode step
        (or sparse, through its decoder) is yielded as a `DecodeStep` whose logits are sent back
        (`decode_batch`). Tokens, `STOP` and the result as in `stream_request`."""
        t_start = time.perf_counter()
        layout = req.layout or self.layout(req.question, req.chunks, req.messages)
        selector = make_selector(req.method, **(req.method_options or {}))
        ratio = self._check_request(layout, req.recompute_ratio, req.max_new_tokens, req.decode,
                                    req.kv_budget, req.decode_options)
        if req.guard not in (None, "full"):
            raise InputError(f"guard must be None or 'full', got {req.guard!r}")
        if isinstance(req.min_new_tokens, bool) or not isinstance(req.min_new_tokens, int) or req.min_new_tokens < 0:
            raise InputError(f"min_new_tokens must be an integer >= 0, got {req.min_new_tokens!r}")
        if req.decode != "full" and selector.adjusts_decode():
            raise InputError(f"method {selector.label!r} changes decode attention (APE scaling / A3 eviction); a "
                             f"sparse decoder ({req.decode!r}) would silently drop that: use decode='full'")
        stats: dict = {"method": selector.label, "ratio": ratio, "prefix_tokens": layout.n_prefix,
                       "context_tokens": layout.n_context, "suffix_tokens": layout.n_suffix,
                       "chunks": len(layout.chunk_ids), "tokenize_s": time.perf_counter() - t_start}
        pre = yield from self._prefill_steps(layout, selector, ratio, req.max_new_tokens, stats, req.auto, cold=True,
                                             batch=batch_prefill)
        if req.guard:
            yield from self._guarded(req, pre, t_start)
            self.precompute_deferred()  # after the answer (a consumer that reads to the end: `run`)
            return
        tokens: list[int] = []
        steps = self.decode_tokens(pre, req.max_new_tokens, req.temperature, req.top_p, req.seed, req.decode,
                                   req.kv_budget, req.decode_options, batch_steps=batch_decode,
                                   min_new_tokens=req.min_new_tokens)
        back = None
        while True:
            try:
                tok = steps.send(back)
            except StopIteration:
                break
            if isinstance(tok, DecodeStep):  # batch_decode: the consumer runs the step, sends its logits
                back = yield tok
                continue
            back = None
            if not tokens:
                stats["ttft_s"] = time.perf_counter() - t_start
                t0 = time.perf_counter()
            tokens.append(tok)
            if (yield tok) is STOP:  # a stop sequence: end after this token, still report the result
                steps.close()
                break
        yield self._result(req, pre, tokens, (time.perf_counter() - t0) / max(len(tokens) - 1, 1))
        self.precompute_deferred()  # cold chunks, after the answer (a consumer that reads to the end: `run`)

    def _result(self, req: GenerationRequest, pre: "Prefill", tokens: list[int], tpot: float) -> GenerationResult:
        stats = pre.stats
        stats.update(recomputed_tokens=int(pre.indices.numel()), order=pre.layout.order, decode_tokens=len(tokens),
                     tpot_s=tpot)
        stats.setdefault("ratio_used", pre.indices.numel() / max(pre.layout.n_context, 1))
        text = self.tokenizer.decode([t for t in tokens if t not in self.eos_ids], skip_special_tokens=True)
        typed = GenerationStats.from_dict(stats)
        return GenerationResult(text=text.strip(), ttft_s=typed.ttft_s, recomputed=pre.indices.tolist(),
                                stats=typed, token_ids=tokens, first_logits=pre.logits[-1].cpu(), method=typed.method)

    def _guarded(self, req: GenerationRequest, pre: "Prefill", t_start: float):
        """guard="full": the stitched greedy answer, verified (and if need be corrected) against full prefill."""
        if req.temperature > 0:
            raise InputError("guard='full' verifies the greedy answer: use temperature 0")
        tokens = list(self.decode_tokens(pre, req.max_new_tokens, 0.0, 1.0, req.seed, req.decode, req.kv_budget,
                                         req.decode_options))
        t0 = time.perf_counter()
        tokens, check = self.verify_against_full(pre.layout, tokens, req.max_new_tokens)
        pre.stats.update(guard={**check, "check_s": time.perf_counter() - t0})
        pre.stats["ttft_s"] = time.perf_counter() - t_start
        for i, tok in enumerate(tokens):
            if (yield tok) is STOP:
                tokens = tokens[:i + 1]
                break
        yield self._result(req, pre, tokens, 0.0)

    @torch.no_grad()
    def verify_against_full(self, layout: PromptLayout, tokens: list[int], max_new_tokens: int):
        """Check a greedy answer against full prefill: teacher-force ``tokens`` after a full prefill of ``layout``
        (one pass); when full prefill's argmax reproduces every token, full prefill's greedy answer IS
        ``tokens`` (same conditioning at every step). Otherwise full prefill's own greedy answer is decoded
        from the first divergence. -> (full prefill's greedy answer, {"agreed", "first_divergence"})."""
        n = layout.n_total
        cache, logits = self.full_prefill(layout, extra=max_new_tokens)
        rows = [logits[-1:]]
        if len(tokens) > 1:
            rows.append(self.forward(cache, torch.tensor(tokens[:-1]), torch.arange(n, n + len(tokens) - 1),
                                     logits_to_keep=len(tokens) - 1))
        pred = torch.cat(rows).argmax(-1).tolist()
        k = 0
        while k < len(tokens) and pred[k] == tokens[k]:
            k += 1
        if k == len(tokens):
            return list(tokens), {"agreed": True, "first_divergence": None}
        fixed = tokens[:k] + [pred[k]]
        cache.truncate(n + k)
        pre = Prefill(cache, layout, logits[-1:], torch.arange(layout.n_context), {}, make_selector("full"),
                      greedy=fixed)
        return list(self.decode_tokens(pre, max_new_tokens)), {"agreed": False, "first_divergence": k}

    @torch.no_grad()
    def answer_logits(self, layout: PromptLayout, answer_ids: torch.Tensor, method: str | Selector,
                      recompute_ratio: float | str = 0.2, method_options: dict | None = None):
        """Teacher-forced next-token logits ``[T, V]`` for ``answer_ids`` (T tokens) after prefilling
        ``layout`` with ``method`` — row i predicts answer token i. For fidelity metrics (KL vs full,
        answer NLL). -> (logits, recomputed context indices, stats)."""
        answer_ids = torch.as_tensor(answer_ids, dtype=torch.long).flatten()
        pre = self.prefill(layout, method, recompute_ratio, max(1, answer_ids.numel()), method_options)
        return self.teacher_force(pre, answer_ids), pre.indices, pre.stats

    @torch.no_grad()
    def teacher_force(self, pre: "Prefill", answer_ids: torch.Tensor, plan: ForwardPlan | None = None) -> torch.Tensor:
        """Logits ``[T, V]`` (float32, cpu) predicting each of ``answer_ids`` after ``pre`` (one pass of the
        first T-1 answer tokens; the cache keeps their K/V)."""
        answer_ids = torch.as_tensor(answer_ids, dtype=torch.long).flatten()
        n, T = pre.layout.n_total, answer_ids.numel()
        pre.cache.truncate(n)
        rows = [pre.logits[-1:].float().cpu()]
        if T > 1:
            rows.append(self.forward(pre.cache, answer_ids[:-1], torch.arange(n, n + T - 1), plan,
                                     logits_to_keep=T - 1).float().cpu())
        return torch.cat(rows)[:max(T, 1)]

    @torch.no_grad()
    def prefill(self, layout: PromptLayout, method: str | Selector = "full", recompute_ratio: float | str = 0.2,
                max_new_tokens: int = 32, method_options: dict | None = None,
                auto: AutoBudget | dict | None = None, selector=None) -> "Prefill":
        """Prefill ``layout`` with ``method`` for callers that drive decoding themselves (`decode_tokens`,
        `decode_step`, the eval harness, benches) -> `Prefill` (cache with room for ``max_new_tokens``).
        ``selector``: a ready `Selector` instance for ``method`` (the eval harness memoises its scores).
        The cold-path policy (`kvstitch.engine.cold`) applies to requests (`generate`, `stream`), not here: missing
        chunks are precomputed and ``method`` always runs."""
        selector = selector or make_selector(method, **(method_options or {}))
        ratio = self._check_request(layout, recompute_ratio, max_new_tokens)
        return self._prefill(layout, selector, ratio, max_new_tokens, {}, auto)

    def _prefill(self, layout: PromptLayout, selector, ratio, max_new_tokens: int, stats: dict,
                 auto=None, cold: bool = False) -> "Prefill":
        steps = self._prefill_steps(layout, selector, ratio, max_new_tokens, stats, auto, cold)
        try:
            next(steps)
        except StopIteration as done:  # without batch=True no pass is handed out
            return done.value
        raise RuntimeError("a lone prefill yielded a recompute step")

    def _prefill_steps(self, layout: PromptLayout, selector, ratio, max_new_tokens: int, stats: dict,
                       auto=None, cold: bool = False, batch: bool = False):
        """`_prefill` as a generator: with ``batch`` its final plain pass (recompute, or full prefill) is
        yielded as a `RecomputeStep` whose logits the consumer sends back; returns the `Prefill`."""
        if selector.full_prefill:
            cache, logits = yield from self._full_prefill_steps(layout, max_new_tokens, batch, stats)
            return Prefill(cache, layout, logits, torch.arange(layout.n_context), stats, selector)
        if ratio == AUTO:
            t0 = time.perf_counter()
            got = adaptive_prefill(self, layout, selector, AutoBudget.of(self.default_auto if auto is None else auto),
                                   max_new_tokens, stats,
                                   selector.recompute_plan)
            if got is None:  # no round converged below the ceiling: full prefill answers
                t1 = time.perf_counter()
                cache, logits = self.full_prefill(layout, extra=max_new_tokens)
                stats.update(ratio_used=1.0, recompute_cost=stats["recompute_cost"] + 1.0,
                             fallback_s=time.perf_counter() - t1, recompute_s=time.perf_counter() - t0)
                return Prefill(cache, layout, logits, torch.arange(layout.n_context), stats, selector)
            stats["recompute_s"] = time.perf_counter() - t0
            return Prefill(got.cache, got.layout, got.logits, got.indices, stats, selector, greedy=got.greedy)
        if cold and take_full_prefill(self, layout, stats):  # cold store: full prefill answers, chunks computed later
            cache, logits = yield from self._full_prefill_steps(layout, max_new_tokens, batch, stats)
            return Prefill(cache, layout, logits, torch.arange(layout.n_context), stats, make_selector("full"))
        kvs = self.chunk_kvs(layout, stats, anchors=selector.chunk_anchors())
        t1 = time.perf_counter()
        cache = self.stitch(layout, kvs, extra=max_new_tokens)
        _sync(self.device)
        t2 = time.perf_counter()
        ctx = SelectionContext(self, cache, layout, round(ratio * layout.n_context), stats,
                               precompute=self.precompute_mode, chunks=kvs)
        indices, _ = selector.select(ctx)
        layout, cache = ctx.layout, ctx.cache  # a selector may reorder chunks (InfoFlow)
        _sync(self.device)
        t3 = time.perf_counter()
        step = self.recompute_step(cache, layout, indices, selector.recompute_plan(ctx))
        logits = yield from self._pass_steps(step, batch)
        _sync(self.device)
        stats.update(assemble_s=t2 - t1, select_s=t3 - t2, recompute_s=time.perf_counter() - t3,
                     ratio_used=indices.numel() / max(layout.n_context, 1))
        if batch and step.seconds is not None:  # the pass's own time, not the wait for the requests packed with it
            stats.update(recompute_s=step.seconds, recompute_batch=step.batch_size)
        return Prefill(cache, layout, logits, indices, stats, selector)

    # ---- decoding -------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, temperature: float, top_p: float, seed: int, step: int = 0,
                no_eos: bool = False) -> int:
        if no_eos:  # the answer is shorter than its min_new_tokens: EOS cannot be chosen
            logits = logits.clone()
            logits[..., sorted(self.eos_ids)] = float("-inf")
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        g = torch.Generator(device="cpu").manual_seed(seed * 100003 + step)
        return int(torch.multinomial(probs.cpu(), 1, generator=g))

    def finished(self, tokens: list[int]) -> bool:
        """True when an answer is complete: it ends with EOS, or a base model wrote its line (`_stop_text`)."""
        return bool(tokens) and (tokens[-1] in self.eos_ids or self._stop_text(tokens))

    @torch.no_grad()
    def decode_tokens(self, pre: "Prefill", max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                      seed: int = 0, decode: str = "full", kv_budget: int | None = None,
                      decode_options: dict | None = None, plan: ForwardPlan | None = None,
                      batch_steps: bool = False, min_new_tokens: int = 0):
        """Yield the answer's tokens after ``pre``: tokens an adaptive prefill already computed greedily
        (``pre.greedy``, their K/V in the cache) first, then decoded ones, until EOS / the cap / a base
        model's line break. After the first token a method's decode plan (APE's attention, A3's eviction)
        applies; ``decode`` != "full" hands the cache to a sparse decoder (see `stream`). ``batch_steps``: plain
        dense steps are yielded as `DecodeStep`s whose logits the consumer sends back (`decode_batch`).
        ``min_new_tokens``: EOS is masked (and a base model's line break does not end the answer) until the
        answer has that many tokens (vLLM's ``min_tokens``: EOS can be the next one) (tokens an adaptive prefill already computed greedily are kept as they are)."""
        stats, cache = pre.stats, pre.cache
        n = pre.layout.n_total
        if pre.greedy and temperature <= 0:
            tokens = list(pre.greedy[:max_new_tokens])
            if len(tokens) < len(pre.greedy):
                cache.truncate(n + len(tokens) - 1)
        else:
            cache.truncate(n)  # sampling: the greedy probe's K/V (if any) are not this answer's
            tokens = [self._sample(pre.logits[-1], temperature, top_p, seed, no_eos=min_new_tokens > 0)]
        yield from tokens

        def done() -> bool:
            return len(tokens) >= max_new_tokens or (len(tokens) >= min_new_tokens and self.finished(tokens))

        if done():
            return
        custom = plan or pre.selector.decode_plan(self, cache, pre.layout, stats)
        plan = custom or ForwardPlan()
        batchable = batch_steps and custom is None  # dense, or through a sparse decoder (`decode_batch`)
        stats["batched_decode"] = batchable
        stats["decode_policy"] = decode  # "full" = dense attention over the contiguous cache
        if decode != "full":
            options = dict(decode_options or {})
            diagnostic = options.pop("diagnostic", False)
            plan.decoder = self.make_decoder(cache, decode, kv_budget, prompt_ids=pre.layout.ids,
                                             diagnostic=diagnostic, reserve_tokens=max_new_tokens,
                                             release=batch_steps, **options)
            stats["kv_budget"] = plan.decoder.kv_budget
            cache.decoder = plan.decoder
        try:
            step = len(tokens) - 1
            while not done():
                step += 1
                if batchable:
                    logits = yield DecodeStep(cache, tokens[-1], plan.decoder)
                    if logits is None:
                        raise InputError("a batched decode step needs its logits sent back (Engine.decode_batch)")
                    if plan.decoder is not None:
                        plan.decoder.end_step()
                elif plan.decoder is None:
                    logits = self.forward(cache, torch.tensor([tokens[-1]]), torch.tensor([cache.length]), plan)
                else:
                    logits = self._decoder_step(cache, tokens[-1], plan)
                    plan.decoder.end_step()
                tokens.append(self._sample(logits[-1], temperature, top_p, seed, step,
                                           no_eos=len(tokens) < min_new_tokens))
                _sync(self.device)
                yield tokens[-1]
            if plan.decoder is not None:
                stats["decoder"] = plan.decoder.stats()
                if plan.decoder.diagnostic:
                    stats["decode_recall"] = plan.decoder.recall.summary()
        finally:
            cache.decoder = None

    @torch.no_grad()
    def decode_batch(self, steps: list[DecodeStep], batched_sparse: bool = True) -> list[torch.Tensor]:
        """Run the pending dense decode steps of several requests in one forward (continuous batching;
        see `kvstitch.engine.batch`) -> each step's next-token logits ``[1, V]``, in order.
        ``batched_sparse=False``: sparse rows attend one by one (the reference of the batched attention)."""
        return decode_batch(self, steps, batched_sparse)

    @torch.no_grad()
    def decode_step(self, cache: StitchCache, token: int, decoder=None) -> torch.Tensor:
        """One decode step for a caller that drives decoding itself (benches): ``token`` at position
        ``cache.length``, dense over ``cache`` or, with ``decoder`` (from `make_decoder`), sparse through
        it (the decoder then owns the K/V: ``cache`` only counts the length, see
        `StitchCache.for_decoder`). Returns the next-token logits ``[1, V]`` (float32)."""
        if decoder is None:
            return self.forward(cache, torch.tensor([token]), torch.tensor([cache.length]))
        plan = ForwardPlan(decoder=decoder)
        cache.decoder = decoder
        try:
            logits = self._decoder_step(cache, token, plan)
        finally:
            cache.decoder = None
        decoder.end_step()
        return logits

    def _stop_text(self, tokens: list[int]) -> bool:
        """Base models (no chat template) keep writing after the answer: stop at the first line break."""
        if getattr(self.tokenizer, "chat_template", None):
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return "\n" in text.lstrip()

    def _decoder_step(self, cache: StitchCache, token: int, plan: ForwardPlan) -> torch.Tensor:
        pos = torch.tensor([[cache.length]], device=self.device)
        with cache.mode(slots=None):
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), position_ids=pos,
                             **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1, kvstitch_plan=plan)
        return out.logits[0].float()

    def new_decoder(self, policy: str, kv_budget: int | None, options: dict | None = None):
        """An empty `SparseDecoder` sized for this model (``options``: see `stream`'s ``decode_options``)."""
        from kvstitch.decode import make_decoder

        options = dict(options or {})
        if not isinstance(options.pop("diagnostic", False), bool):
            raise InputError("decode option 'diagnostic' must be true or false")
        ad = self.adapter
        return make_decoder(policy, kv_budget or 1024, num_layers=ad.num_layers, num_q_heads=ad.num_q_heads,
                            num_kv_heads=ad.num_kv_heads, head_dim=ad.head_dim, device=self.device, dtype=self.dtype,
                            **options)

    @torch.no_grad()
    def observation_queries(self, cache: StitchCache, prompt_ids: torch.Tensor, window: int = 32) -> dict:
        """Post-RoPE queries ``{layer: [Hq, w, D]}`` of the last ``window`` prompt tokens (the observation
        window of static decode policies), taken by re-running those tokens out of place (the cache is
        left untouched)."""
        n = cache.length
        if prompt_ids.numel() != n:
            raise InputError(f"the cache holds {n} tokens but the prompt has {prompt_ids.numel()}")
        w = min(window, n)
        plan = ForwardPlan(capture_queries=w)
        self.forward(cache, prompt_ids[n - w:n], torch.arange(n - w, n), plan, write=False)
        return plan.queries

    @torch.no_grad()
    def make_decoder(self, cache: StitchCache, policy: str, kv_budget: int | None = None, *,
                     prompt_ids: torch.Tensor | None = None, obs_queries: dict | None = None,
                     diagnostic: bool = False, reserve_tokens: int | None = None, release: bool = False,
                     **options):
        """Hand the prefilled ``cache`` to a sparse decoder (PRKV & co.): every layer's K/V are copied to its
        host pool, so the cache itself is not modified and can seed several decoders. Static policies
        score with the observation window: ``obs_queries`` (from `observation_queries`), else computed
        from ``prompt_ids`` (the prompt's token ids). ``diagnostic``: record the attention recall of every
        step (``decoder.recall``); ``options``: see `stream`'s ``decode_options``. ``reserve_tokens``: room
        for that many decoded tokens in the decoder's pools (a server's memory accounting counts them).
        ``release``: the cache gives up its K/V layer by layer as the decoder takes them (it then only
        counts the length; the K/V of a request are never held twice: the batching server)."""
        dec = self.new_decoder(policy, kv_budget, {**options, "diagnostic": diagnostic})
        if reserve_tokens is not None:
            dec.reserve_tokens = reserve_tokens
        if obs_queries is None:
            if prompt_ids is None:
                raise InputError("make_decoder needs the prompt's token ids (prompt_ids) or obs_queries")
            obs_queries = self.observation_queries(cache, prompt_ids, window=dec.window)  # = the local window
        n = cache.length
        ad = self.adapter
        layers = ad.backbone.layers
        for i, layer in enumerate(cache.layers):
            dec.load_prefill(i, layer.keys[0, :, :n], layer.values[0, :, :n], obs_queries[i],
                             sliding_window=ad.sliding_window(i), scaling=layers[i].self_attn.scaling,
                             inv_freq=ad.inv_freq(i))
            if release:
                layer.keys, layer.values = layer.keys[:, :, :0].clone(), layer.values[:, :, :0].clone()
        dec.diagnostic = diagnostic
        return dec
