"""`Engine`: the facade over one model. It loads the model, precomputes and stores chunk caches, and answers
requests; the work is done by its modules, each over the engine's public members:

- `request`: the request (`GenerationRequest`), its one validation, the `Prefill` and the result;
- `prefill`: stitch, select, recompute, the cold path (`cold`) and the adaptive budget (`budget`);
- `answer`: sampling, dense and sparse steps, the stop rules, the answer's text;
- `verify`: the full-prefill guard and teacher forcing;
- `batch`: the batched passes of the server's scheduler (`Engine.steps`); `hooks`: the seams a harness uses;
- `precompute`: chunk caches (`compute_chunks`, `chunk_kvs`); `device`: the default device and dtype.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Sequence

import torch

from kvstitch.core.attention import ForwardPlan, StopForward
from kvstitch.core.cache import StitchCache
from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import InputError
from kvstitch.core.identity import register_model, tokenizer_fingerprint
from kvstitch.core.prompt import PromptBuilder, PromptLayout
from kvstitch.core.rope import inv_freq_table, self_check
from kvstitch.models import adapter_for, cache_kwargs, load_model
from kvstitch.models.loader import embedded_name
from kvstitch.models.half_cpu import multiplies_natively
from kvstitch.models.stitch_adapter import StitchAdapter, gate_of, gated, resolve_adapter
from kvstitch.decode.policies import DecodePolicy
from kvstitch.select import Selector
from kvstitch.store import ChunkStore, check_precompute, chunk_key, open_store
from . import answer, prefill, sampling, verify
from .batch import DecodeStep, RecomputeStep, decode_batch, recompute_batch
from .budget import AutoBudget
from .cold import DEFAULT_COLD_THRESHOLD, DeferredPrecompute, check_cold_path, precompute_deferred
from .device import cpu_name, default_device, fast_dtype
from .hooks import EngineHooks, hooked
from .precompute import PrecomputeReport, check_anchors, forward_chunks, load_chunk_kvs, precompute_texts
from .request import (DEFAULT_METHOD, STOP, GenerationRequest, GenerationResult, Prefill, build_layout,
                      check_request)
from .stitch import writer_tag

__all__ = ["DEFAULT_METHOD", "STOP", "Engine", "GenerationRequest", "GenerationResult", "Prefill", "cpu_name",
           "default_device", "fast_dtype"]

log = logging.getLogger("kvstitch.engine")
_DTYPES = ("float32", "bfloat16", "float16")  # model dtypes Engine.load accepts by name


class Engine:
    def __init__(self, model, tokenizer, weights_id: str, store: ChunkStore | None = None,
                 check_rope: bool = True, precompute: str = "shared_prefix", cold_path: str = "auto",
                 cold_threshold: float = DEFAULT_COLD_THRESHOLD, stitch_adapter: StitchAdapter | None = None):
        """``precompute``: how chunk caches are computed - "shared_prefix" (after the shared prefix, the one
        attention sink) or "isolated" (each chunk from position 0 on its own, as A3 / InfoFlow do); part of
        the chunk store key. ``cold_path`` / ``cold_threshold``: what a request whose chunks are missing from
        the store does ("auto": full prefill when more than the threshold of its context is missing, the
        chunks precomputed off the request path; see `kvstitch.engine.cold`)."""
        self.precompute_mode = check_precompute(precompute)
        self.cold_path, self.cold_threshold = check_cold_path(cold_path, cold_threshold)
        self.deferred = DeferredPrecompute()
        self.default_auto: AutoBudget | dict | None = None  # options of ratio "auto" for requests that give none
        self.hooks = EngineHooks()  # the seams a harness sets for a block of work (`hooked`)
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
        self.vocab_size = model.get_input_embeddings().weight.shape[0]  # link tokens' ids start here
        self.stitch_adapter: StitchAdapter | None = None
        if stitch_adapter is not None:
            self.use_stitch_adapter(stitch_adapter)

    def use_stitch_adapter(self, adapter: StitchAdapter | None) -> None:
        """Read stitched caches through ``adapter`` from now on (None: detach the current one). Passage caches
        are unaffected either way: the adapter works at query time only."""
        if self.stitch_adapter is not None:
            self.stitch_adapter.detach()
            self.stitch_adapter = None
        if adapter is not None:
            adapter.check_model(self.weights_id, self.model_name)
            adapter.attach(self.model)
            self.stitch_adapter = adapter

    @property
    def model_name(self) -> str:
        """The embedded model's name (``qwen2.5-0.5b``), else the weights' identity."""
        return embedded_name(self.weights_id) or self.weights_id

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, store=None, device: str | None = None,
             dtype: str | torch.dtype | None = None, storage_dtype: str = "float16",
             stitch_adapter: str | StitchAdapter | None = "auto", **kwargs) -> "Engine":
        """``model``: None (embedded SmolLM2-135M-Instruct), "gemma3", "qwen2.5-0.5b" (the reference model), "qwen2.5-1.5b", an HF
        directory or a .gguf file.
        ``store``: None (in-memory), a directory path, "redis://host:port/db" or "tiered:A,B"; chunk K/V
        are kept in ``storage_dtype`` (float16, bfloat16, float32 or int8).
        ``dtype``: the model's; default float32 on CPU, bfloat16 on CUDA; "fast" = `fast_dtype` of the device.
        ``stitch_adapter``: "auto" (the one kvstitch ships for this embedded model where it measured better than
        none, today Qwen2.5 0.5B's; else none), None (no adapter), "default" (the shipped one, whatever it
        measured), a file path or a `StitchAdapter` (`kvstitch.models.stitch_adapter`)."""
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
        stitch = resolve_adapter(stitch_adapter, model)  # a bad adapter file, likewise
        check_precompute(kwargs.get("precompute", "shared_prefix"))
        model_, tok, weights_id = load_model(model, dev, dtype)
        return cls(model_, tok, weights_id, store=store_, stitch_adapter=stitch, **kwargs)

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
        gate = gate_of(cache.reader_gate(slots)) if cache.adapted else None  # (no device sync without an adapter)
        with cache.mode(slots=slots, write=write), gated(gate):
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

    def compute_chunks(self, prefix_ids: torch.Tensor, chunks: list[torch.Tensor], batch_size: int = 8) -> list[ChunkKV]:
        """Precompute several chunks, ``batch_size`` per forward. Chunks of a batch are right-padded to
        one length; causal masks keep every real token blind to the padding after it. In ``isolated``
        precompute mode a chunk runs alone from position 0 (no prefix; ``ChunkKV.start`` = 0)."""
        return forward_chunks(self, prefix_ids, chunks, batch_size)

    def chunk_key(self, prefix_ids: torch.Tensor, chunk_ids: torch.Tensor) -> str:
        return chunk_key(self.fingerprint, prefix_ids, chunk_ids, getattr(self.store, "storage_dtype", "native"),
                         precompute=self.precompute_mode, tokenizer=self.tokenizer_id,
                         writer=writer_tag(self))

    def chunk_kvs(self, layout: PromptLayout, stats: dict | None = None, anchors=None) -> list[ChunkKV]:
        """Look every chunk up in the store; precompute the misses (batched) and write them back. ``anchors``
        (an `AnchorSpec`, what `qcfuse` needs): every chunk carries its anchor scores too (`kvstitch.core.anchors`)."""
        return load_chunk_kvs(self, layout, stats, anchors)

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
        return precompute_texts(self, texts, chunk_tokens, overlap, batch_size, progress, check_anchors(anchors))

    def precompute_deferred(self, max_chunks: int | None = None) -> int:
        """Compute and store the chunks cold requests answered by full prefill left behind (`kvstitch.engine.cold`);
        up to ``max_chunks`` of them -> how many were handled. Call it off the request path."""
        return precompute_deferred(self, max_chunks)


    def hooked(self, **hooks):
        """Set `EngineHooks` (``full_prefill=``, ``score=``) for the block, then restore the ones before."""
        return hooked(self.hooks, **hooks)

    # ---- prefill (`kvstitch.engine.prefill`) -----------------------------------------------------
    def layout(self, question: str | None, chunks: list[str] | None,
               messages: list[dict] | None = None) -> PromptLayout:
        """The prompt of ``question`` over ``chunks`` (or of the conversation ``messages``), checked."""
        return build_layout(self.builder, question, chunks, messages)

    def stitch(self, layout: PromptLayout, chunks: list[ChunkKV], extra: int = 0) -> StitchCache:
        """Prefix K/V + every chunk's K/V, keys re-rotated from precompute to global positions."""
        return prefill.stitch(self, layout, chunks, extra)

    def recompute(self, cache: StitchCache, layout: PromptLayout, indices: torch.Tensor,
                  plan: ForwardPlan | None = None, logits_to_keep: int = 1) -> torch.Tensor:
        """One pass of the selected context tokens plus the suffix, at their global positions, through
        all layers; their fresh K/V overwrite the stitched cache. Returns the suffix's last logits."""
        step = prefill.recompute_step(cache, layout, indices, plan)
        return self.forward(cache, step.ids, step.slots, plan, logits_to_keep=logits_to_keep)

    @torch.no_grad()
    def recompute_batch(self, steps: list[RecomputeStep]) -> list[torch.Tensor]:
        """Run the recompute passes of several requests as one packed forward (`kvstitch.engine.batch`) -> each
        pass's last logits ``[1, V]``, in order, as if it ran alone (one step: the lone path)."""
        return recompute_batch(self, steps)

    def full_prefill(self, layout: PromptLayout, extra: int = 0, plan: ForwardPlan | None = None,
                     logits_to_keep: int = 1) -> tuple[StitchCache, torch.Tensor]:
        """The whole prompt over an empty cache (room for ``extra`` tokens) -> (cache, last logits); through
        the ``full_prefill`` hook when one is set."""
        if self.hooks.full_prefill is None:
            return prefill.compute_full_prefill(self, layout, extra, plan, logits_to_keep)
        return self.hooks.full_prefill(layout, extra, plan, logits_to_keep,
                                       functools.partial(prefill.compute_full_prefill, self))

    @torch.no_grad()
    def prefill(self, layout: PromptLayout, method: str | Selector = "full",
                recompute_ratio: float | str | AutoBudget = 0.2,
                max_new_tokens: int = 32, method_options: dict | None = None,
                auto: AutoBudget | dict | None = None, selector: Selector | None = None) -> Prefill:
        """Prefill ``layout`` with ``method`` for callers that drive decoding themselves (`decode_tokens`,
        `decode_step`, the eval harness, benches) -> `Prefill` (cache with room for ``max_new_tokens``).
        ``selector``: a ready `Selector` instance for ``method`` (the eval harness memoises its scores).
        The cold-path policy (`kvstitch.engine.cold`) applies to requests (`generate`, `stream`), not here: missing
        chunks are precomputed and ``method`` always runs."""
        req = GenerationRequest(layout=layout, method=method, recompute_ratio=recompute_ratio,
                                max_new_tokens=max_new_tokens, method_options=method_options, auto=auto)
        checked = check_request(self, req, selector)
        return prefill.prefill(self, layout, checked.selector, checked.ratio, max_new_tokens, {}, checked.auto)

    # ---- the public entry points --------------------------------------------------------------
    @torch.no_grad()
    def generate(self, question: str | None = None, chunks: list[str] | None = None, *,
                 messages: list[dict] | None = None, method: str | Selector = DEFAULT_METHOD,
                 recompute_ratio: float | str | AutoBudget = 0.2, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, decode: str | DecodePolicy = "dense", kv_budget: int | None = None,
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
        for event in self.steps(request):
            if isinstance(event, GenerationResult):
                result = event
        return result

    @torch.no_grad()
    def stream(self, question: str | None = None, chunks: list[str] | None = None, *,
               messages: list[dict] | None = None, method: str | Selector = DEFAULT_METHOD,
               recompute_ratio: float | str | AutoBudget = 0.2, max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, decode: str | DecodePolicy = "dense", kv_budget: int | None = None,
               auto: AutoBudget | dict | None = None, guard: str | None = None,
               method_options: dict | None = None, decode_options: dict | None = None, min_new_tokens: int = 0,
               layout: PromptLayout | None = None):
        """`generate`, streamed: yield each answer token id (int) as it is produced, then the
        `GenerationResult` (see `steps`)."""
        yield from self.steps(GenerationRequest(
            question=question, chunks=chunks, messages=messages, method=method, recompute_ratio=recompute_ratio,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, decode=decode,
            kv_budget=kv_budget, auto=auto, guard=guard, method_options=method_options,
            decode_options=decode_options, min_new_tokens=min_new_tokens, layout=layout))

    @torch.no_grad()
    def steps(self, req: GenerationRequest, *, batch_decode: bool = False, batch_prefill: bool = False):
        """Run ``req``: yield each generated token id (int) as it is produced, then the `GenerationResult`.

        Input errors are raised before anything is computed. A consumer that stops iterating stops the generation
        (servers use this when a client disconnects); one that ``send(STOP)`` instead of ``next()`` ends it after
        the token just yielded (stop sequences), the result then holding the tokens so far. With ``guard="full"``
        the stitched answer is checked against full prefill before any token is yielded (`kvstitch.engine.verify`).
        The engine keeps no state between requests: every per-request object lives in the `Prefill`.

        For a batching consumer (the server's scheduler), which runs the model passes of several requests
        together: ``batch_prefill``: where the prefill's pass (recompute, or full prefill) would run, if it is
        plain (`kvstitch.engine.batch.can_batch`), a `RecomputeStep` is yielded instead and its logits are sent
        back (`recompute_batch` runs several). ``batch_decode``: every dense decode step (or sparse, through its
        decoder) is yielded as a `DecodeStep` whose logits are sent back (`decode_batch`)."""
        t_start = time.perf_counter()
        checked = check_request(self, req)
        layout, selector = checked.layout, checked.selector
        stats: dict = {"method": selector.label, "ratio": checked.ratio, "prefix_tokens": layout.n_prefix,
                       "context_tokens": layout.n_context, "suffix_tokens": layout.n_suffix,
                       "chunks": len(layout.chunk_ids), "tokenize_s": time.perf_counter() - t_start}
        pre = yield from prefill.prefill_steps(self, layout, selector, checked.ratio, req.max_new_tokens, stats,
                                               checked.auto, cold=True, batch=batch_prefill)
        if req.guard:
            yield from verify.guarded(self, req, pre, t_start)
        else:
            yield from answer.stream_answer(self, req, pre, t_start, batch_decode)
        self.precompute_deferred()  # cold chunks, after the answer (a consumer that reads to the end: `run`)

    # ---- decoding (`kvstitch.engine.answer`) ---------------------------------------------------
    def finished(self, tokens: list[int]) -> bool:
        """True when an answer is complete: it ends with EOS, or a base model wrote its line (no chat template:
        it stops at the first line break)."""
        return sampling.finished(self, tokens)

    def answer_text(self, tokens: Sequence[int], strip: bool = True) -> str:
        """The text of answer ``tokens``: EOS dropped, special tokens skipped; stripped unless ``strip`` is False."""
        return sampling.answer_text(self, list(tokens), strip)

    def decode_tokens(self, pre: Prefill, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                      seed: int = 0, decode: str | DecodePolicy = "dense", kv_budget: int | None = None,
                      decode_options: dict | None = None, plan: ForwardPlan | None = None,
                      batch_steps: bool = False, min_new_tokens: int = 0):
        """Yield the answer's tokens after ``pre``: tokens an adaptive prefill already computed greedily
        (``pre.greedy``, their K/V in the cache) first, then decoded ones, until EOS / the cap / a base
        model's line break. After the first token a method's decode plan (APE's attention, A3's eviction)
        applies; a sparse ``decode`` policy (any but `dense`) hands the cache to a sparse decoder. ``batch_steps``: plain steps are
        yielded as `DecodeStep`s whose logits the consumer sends back (`decode_batch`). ``min_new_tokens``: EOS
        is masked (and a base model's line break does not end the answer) until the answer has that many
        tokens (vLLM's ``min_tokens``; tokens an adaptive prefill already computed are kept as they are)."""
        return answer.decode_tokens(self, pre, max_new_tokens, temperature, top_p, seed, decode, kv_budget,
                                      decode_options, plan, batch_steps, min_new_tokens)

    @torch.no_grad()
    def decode_batch(self, steps: list[DecodeStep], batched_sparse: bool = True) -> list[torch.Tensor]:
        """Run the pending dense decode steps of several requests in one forward (continuous batching;
        see `kvstitch.engine.batch`) -> each step's next-token logits ``[1, V]``, in order.
        ``batched_sparse=False``: sparse rows attend one by one (the reference of the batched attention)."""
        return decode_batch(self, steps, batched_sparse)

    def decode_step(self, cache: StitchCache, token: int, decoder=None) -> torch.Tensor:
        """One decode step for a caller that drives decoding itself (benches): ``token`` at position
        ``cache.length``, dense over ``cache`` or, with ``decoder`` (from `make_decoder`), sparse through
        it (the decoder then owns the K/V: ``cache`` only counts the length, see
        `StitchCache.for_decoder`). Returns the next-token logits ``[1, V]`` (float32)."""
        return answer.decode_step(self, cache, token, decoder)

    def make_decoder(self, cache: StitchCache, policy: str | DecodePolicy, kv_budget: int | None = None, *,
                     prompt_ids: torch.Tensor | None = None, obs_queries: dict | None = None,
                     diagnostic: bool = False, reserve_tokens: int | None = None, release: bool = False,
                     **options):
        """Hand the prefilled ``cache`` to a sparse decoder (PRKV & co.): every layer's K/V are copied to its
        host pool, so the cache itself is not modified and can seed several decoders. Static policies
        score with the observation window: ``obs_queries`` (`kvstitch.engine.answer.observation_queries`), else computed
        from ``prompt_ids`` (the prompt's token ids). ``diagnostic``: record the attention recall of every
        step (``decoder.recall``); ``options``: `GenerationRequest.decode_options`. ``reserve_tokens``: room
        for that many decoded tokens in the decoder's pools (a server's memory accounting counts them).
        ``release``: the cache gives up its K/V layer by layer as the decoder takes them (it then only
        counts the length; the K/V of a request are never held twice: the batching server)."""
        return answer.make_decoder(self, cache, policy, kv_budget, prompt_ids=prompt_ids, obs_queries=obs_queries,
                                     diagnostic=diagnostic, reserve_tokens=reserve_tokens, release=release,
                                     **options)

    # ---- verification (`kvstitch.engine.verify`) -------------------------------------------------
    def teacher_force(self, pre: Prefill, answer_ids: torch.Tensor, plan: ForwardPlan | None = None) -> torch.Tensor:
        """Logits ``[T, V]`` (float32, cpu) predicting each of ``answer_ids`` after ``pre`` (one pass of the
        first T-1 answer tokens; the cache keeps their K/V)."""
        return verify.teacher_force(self, pre, answer_ids, plan)

    @torch.no_grad()
    def answer_logits(self, layout: PromptLayout, answer_ids: torch.Tensor, method: str | Selector,
                      recompute_ratio: float | str = 0.2, method_options: dict | None = None):
        """Teacher-forced next-token logits ``[T, V]`` for ``answer_ids`` (T tokens) after prefilling
        ``layout`` with ``method`` — row i predicts answer token i. For fidelity metrics (KL vs full,
        answer NLL). -> (logits, recomputed context indices, stats)."""
        answer_ids = torch.as_tensor(answer_ids, dtype=torch.long).flatten()
        pre = self.prefill(layout, method, recompute_ratio, max(1, answer_ids.numel()), method_options)
        return self.teacher_force(pre, answer_ids), pre.indices, pre.stats
