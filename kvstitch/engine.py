"""`Engine`: load a model, precompute/stitch chunk caches, recompute a budget of tokens, decode."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field

import torch

from .attention import ForwardPlan, StopForward
from .cache import StitchCache
from .chunk import ChunkKV
from .errors import BadRatio, InputError, PromptTooLong, UnknownDecodePolicy
from .models import adapter_for, load_model
from .prompt import PromptBuilder, PromptLayout
from .rope import inv_freq_table, rerotate, self_check
from .select import SelectionContext, check_method, make_selector
from .store import ChunkStore, chunk_key, open_store
from .store.codec import roundtrip

DEFAULT_METHOD = "prophet"


@dataclass
class GenerationResult:
    text: str
    ttft_s: float
    recomputed: list[int]  # context-token indices (0-based within the context) that were recomputed
    stats: dict
    token_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None  # logits of the first answer token (float32, cpu)
    method: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    def __init__(self, model, tokenizer, weights_id: str, store: ChunkStore | None = None,
                 check_rope: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter_for(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.builder = PromptBuilder(tokenizer)
        self.store = store if store is not None else open_store(None, compute_dtype=self.dtype)
        self.inv_freq = inv_freq_table(self.adapter).to(self.device)
        self.fingerprint = self._fingerprint(weights_id)
        if getattr(self.store, "fingerprint", None) is None and hasattr(self.store, "fingerprint"):
            self.store.fingerprint = self.fingerprint  # entries of another model are reported, never used
        self._prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.eos_ids = self._eos_ids()
        self.rope_error = self_check(model, self.adapter, self._probe_ids()) if check_rope else None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, store=None, device: str | None = None,
             dtype: str | torch.dtype | None = None, storage_dtype: str = "float16", **kwargs) -> "Engine":
        """``model``: None (embedded SmolLM2-135M-Instruct), "gemma3", an HF directory or a .gguf file.
        ``store``: None (in-memory), a directory path, "redis://host:port/db" or "tiered:A,B"; chunk K/V
        are kept in ``storage_dtype`` (float16, bfloat16, float32 or int8)."""
        dev = torch.device(device) if device else default_device()
        if dtype is None:
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        store_ = open_store(store, storage_dtype=storage_dtype, compute_dtype=dtype)  # fail fast: before the model
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
                logits_to_keep: int = 1, write: bool = True) -> torch.Tensor | None:
        """Run ``ids`` at global positions ``slots`` (sorted) over ``cache``; returns the last logits.
        Returns None when the plan stopped the pass early (scoring passes)."""
        plan = plan or ForwardPlan()
        slots = slots.to(self.device)
        plan.q_slots = slots
        with cache.mode(slots=slots, write=write):
            try:
                ids = ids.view(1, -1) if ids.dim() == 1 else ids
                out = self.model(input_ids=ids.to(self.device),
                                 position_ids=slots.view(1, -1).expand(ids.shape[0], -1),
                                 past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
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
        one length; causal masks keep every real token blind to the padding after it."""
        pk, pv = self.prefix_kv(prefix_ids)
        p = prefix_ids.numel()
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
        return chunk_key(self.fingerprint, prefix_ids, chunk_ids, getattr(self.store, "storage_dtype", "native"))

    def chunk_kvs(self, layout: PromptLayout, stats: dict | None = None) -> list[ChunkKV]:
        """Look every chunk up in the store; precompute the misses (batched) and write them back."""
        t0 = time.perf_counter()
        keys = [self.chunk_key(layout.prefix_ids, ids) for ids in layout.chunk_ids]
        found: list[ChunkKV | None] = []
        for key, ids in zip(keys, layout.chunk_ids):
            kv = self.store.lookup(key)
            if kv is not None and (kv.fingerprint != self.fingerprint or not torch.equal(kv.token_ids, ids.cpu())):
                kv = None  # a key collision or a foreign entry: never use it
            found.append(kv)
        miss = [i for i, kv in enumerate(found) if kv is None]
        if miss:
            fresh = self.compute_chunks(layout.prefix_ids, [layout.chunk_ids[i] for i in miss])
            storage = getattr(self.store, "storage_dtype", "float32")
            for i, kv in zip(miss, fresh):
                self.store.put(keys[i], kv)
                # use what a later hit will return (storage dtype), so cold and warm requests agree
                found[i] = roundtrip(kv, storage, self.dtype)
        if stats is not None:
            stats.update(store_hits=len(found) - len(miss), store_misses=len(miss),
                         chunk_load_s=time.perf_counter() - t0)
        return [kv.to(self.device, self.dtype) for kv in found]

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
        slots = torch.cat([indices.to(torch.long).cpu() + layout.context_start,
                           torch.arange(layout.context_end, layout.n_total)])
        ids = layout.ids[slots]
        return self.forward(cache, ids, slots, plan, logits_to_keep=logits_to_keep)

    def full_prefill(self, layout: PromptLayout, extra: int = 0, plan: ForwardPlan | None = None,
                     logits_to_keep: int = 1) -> tuple[StitchCache, torch.Tensor]:
        cache = StitchCache.empty(self.adapter, layout.n_total + extra, self.device, self.dtype)
        logits = self.forward(cache, layout.ids, torch.arange(layout.n_total), plan, logits_to_keep)
        return cache, logits

    # ---- validation -----------------------------------------------------------------------------
    def layout(self, question: str, chunks: list[str]) -> PromptLayout:
        if not isinstance(question, str) or not question.strip():
            raise InputError("the question is empty")
        if not chunks:
            raise InputError("no chunks given: pass at least one passage")
        for i, c in enumerate(chunks):
            if not isinstance(c, str) or not c.strip():
                raise InputError(f"chunk {i} is empty")
        return self.builder.build(question, chunks)

    def _check_request(self, layout: PromptLayout, method: str, ratio: float, max_new_tokens: int,
                       decode: str = "full", kv_budget: int | None = None,
                       decode_options: dict | None = None) -> None:
        check_method(method)
        if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0.0 <= ratio <= 1.0:
            raise BadRatio(f"recompute_ratio must be in [0, 1], got {ratio!r}")
        from .decode import DECODE_POLICIES

        if decode != "full" and decode not in DECODE_POLICIES:
            raise UnknownDecodePolicy(f"unknown decode policy {decode!r}; known: full, "
                                      f"{', '.join(sorted(DECODE_POLICIES))}")
        if kv_budget is not None and (not isinstance(kv_budget, int) or kv_budget < 1):
            raise InputError(f"kv_budget must be a positive integer, got {kv_budget!r}")
        if decode_options is not None and (decode == "full" or not isinstance(decode_options, dict)):
            raise InputError("decode_options (a dict) configure a sparse decoder; decode='full' (dense) takes none")
        if decode != "full":
            self._new_decoder(decode, kv_budget, decode_options)  # bad options / a too-small budget fail here
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        limit = self.adapter.max_positions
        if layout.n_total + max_new_tokens > limit:
            raise PromptTooLong(f"prompt is {layout.n_total} tokens + {max_new_tokens} new tokens > the model's "
                                f"limit of {limit} positions; pass fewer or shorter chunks (nothing is truncated)")

    # ---- the public entry points --------------------------------------------------------------
    @torch.no_grad()
    def generate(self, question: str, chunks: list[str], method: str = DEFAULT_METHOD,
                 recompute_ratio: float = 0.2, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, decode: str = "full", kv_budget: int | None = None,
                 method_options: dict | None = None, layout: PromptLayout | None = None,
                 decode_options: dict | None = None) -> GenerationResult:
        """Answer ``question`` over ``chunks`` (see `stream` for the arguments)."""
        result = None
        for event in self.stream(question, chunks, method, recompute_ratio, max_new_tokens, temperature, top_p,
                                 seed, decode, kv_budget, method_options, layout, decode_options):
            if isinstance(event, GenerationResult):
                result = event
        return result

    @torch.no_grad()
    def stream(self, question: str, chunks: list[str], method: str = DEFAULT_METHOD,
               recompute_ratio: float = 0.2, max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, decode: str = "full", kv_budget: int | None = None,
               method_options: dict | None = None, layout: PromptLayout | None = None,
               decode_options: dict | None = None):
        """Yield each generated token id (int) as it is produced, then the `GenerationResult`.

        ``decode_options`` (sparse ``decode`` only): ``diagnostic=True`` also runs dense attention at every
        step and puts the attention recall in ``stats["decode_recall"]`` (slow: a measurement mode);
        ``page_size``, ``device_pages`` and the policy's fields (``static_ratio``, ``refresh_interval``,
        ``window``, ``sinks``, ...) go to `kvstitch.decode.make_decoder`. A sparse decode also reports the
        decoder's counters (pages copied, selected tokens, ...) in ``stats["decoder"]``.

        Input errors are raised before anything is computed. A consumer that stops iterating stops the
        generation (servers use this when a client disconnects)."""
        t_start = time.perf_counter()
        layout = layout or self.layout(question, chunks)
        self._check_request(layout, method, recompute_ratio, max_new_tokens, decode, kv_budget, decode_options)
        selector = make_selector(method, **(method_options or {}))
        if decode != "full" and selector.adjusts_decode():
            raise InputError(f"method {method!r} changes decode attention (APE scaling / A3 eviction); a sparse "
                             f"decoder ({decode!r}) would silently drop that: use decode='full'")
        stats: dict = {"method": method, "ratio": recompute_ratio, "prefix_tokens": layout.n_prefix,
                       "context_tokens": layout.n_context, "suffix_tokens": layout.n_suffix,
                       "chunks": len(layout.chunk_ids), "tokenize_s": time.perf_counter() - t_start}
        cache, layout, logits, indices = self._prefill(layout, selector, recompute_ratio, max_new_tokens, stats)
        self._current_ids = layout.ids
        first = self._sample(logits[-1], temperature, top_p, seed)
        ttft = time.perf_counter() - t_start
        stats.update(recomputed_tokens=int(indices.numel()), ttft_s=ttft, order=layout.order)
        tokens = [first]
        yield first
        t0, steps = time.perf_counter(), 0
        # after the first token: a method's decode plan (APE's attention, A3's KV eviction), if any
        more = max_new_tokens > 1 and first not in self.eos_ids
        dplan = selector.decode_plan(self, cache, layout, stats) if more else None
        for tok in self._decode(cache, first, max_new_tokens, temperature, top_p, seed, decode, kv_budget, stats,
                                dplan, decode_options):
            tokens.append(tok)
            steps += 1
            yield tok
        stats.update(decode_tokens=len(tokens), tpot_s=(time.perf_counter() - t0) / max(steps, 1))
        text = self.tokenizer.decode([t for t in tokens if t not in self.eos_ids], skip_special_tokens=True)
        yield GenerationResult(text=text.strip(), ttft_s=ttft, recomputed=indices.tolist(), stats=stats,
                               token_ids=tokens, first_logits=logits[-1].cpu(), method=method)

    @torch.no_grad()
    def answer_logits(self, layout: PromptLayout, answer_ids: torch.Tensor, method: str,
                      recompute_ratio: float = 0.2, method_options: dict | None = None):
        """Teacher-forced next-token logits ``[T, V]`` for ``answer_ids`` (T tokens) after prefilling
        ``layout`` with ``method`` — row i predicts answer token i. For fidelity metrics (KL vs full,
        answer NLL). -> (logits, recomputed context indices, stats)."""
        answer_ids = torch.as_tensor(answer_ids, dtype=torch.long).flatten()
        self._check_request(layout, method, recompute_ratio, max(1, answer_ids.numel()))
        stats: dict = {}
        selector = make_selector(method, **(method_options or {}))
        cache, layout, logits, indices = self._prefill(layout, selector, recompute_ratio, answer_ids.numel(), stats)
        rows = [logits[-1:]]
        if answer_ids.numel() > 1:
            n = layout.n_total
            rows.append(self.forward(cache, answer_ids[:-1], torch.arange(n, n + answer_ids.numel() - 1),
                                     logits_to_keep=answer_ids.numel() - 1))
        return torch.cat(rows).cpu(), indices, stats

    @torch.no_grad()
    def prefill(self, layout: PromptLayout, method: str = "full", recompute_ratio: float = 0.2,
                max_new_tokens: int = 32, method_options: dict | None = None):
        """Prefill ``layout`` with ``method``, for callers that drive decoding themselves (`decode_step`,
        benches) -> (cache with room for ``max_new_tokens``, layout used, suffix logits, recomputed context
        indices, stats). Methods that change decode attention (APE, A3 eviction) are refused: their decode
        plan would be lost."""
        self._check_request(layout, method, recompute_ratio, max_new_tokens)
        selector = make_selector(method, **(method_options or {}))
        if selector.adjusts_decode():
            raise InputError(f"method {method!r} changes decode attention (APE scaling / A3 eviction): "
                             f"use generate()")
        stats: dict = {}
        cache, layout, logits, indices = self._prefill(layout, selector, recompute_ratio, max_new_tokens, stats)
        return cache, layout, logits, indices, stats

    def _prefill(self, layout: PromptLayout, selector, ratio: float, max_new_tokens: int, stats: dict):
        """-> (cache ready for decode, layout used, suffix logits, recomputed context indices)."""
        if selector.full_prefill:
            cache, logits = self.full_prefill(layout, extra=max_new_tokens)
            return cache, layout, logits, torch.arange(layout.n_context)
        kvs = self.chunk_kvs(layout, stats)
        t1 = time.perf_counter()
        cache = self.stitch(layout, kvs, extra=max_new_tokens)
        _sync(self.device)
        t2 = time.perf_counter()
        ctx = SelectionContext(self, cache, layout, round(ratio * layout.n_context), stats)
        indices, _ = selector.select(ctx)
        layout, cache = ctx.layout, ctx.cache  # a selector may reorder chunks (InfoFlow)
        _sync(self.device)
        t3 = time.perf_counter()
        logits = self.recompute(cache, layout, indices, selector.recompute_plan(ctx))
        _sync(self.device)
        stats.update(assemble_s=t2 - t1, select_s=t3 - t2, recompute_s=time.perf_counter() - t3)
        return cache, layout, logits, indices

    # ---- decoding -------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, temperature: float, top_p: float, seed: int, step: int = 0) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        g = torch.Generator(device="cpu").manual_seed(seed * 100003 + step)
        return int(torch.multinomial(probs.cpu(), 1, generator=g))

    def _decode(self, cache: StitchCache, first: int, max_new_tokens: int, temperature: float, top_p: float,
                seed: int, decode: str, kv_budget: int | None, stats: dict, plan: ForwardPlan | None = None,
                decode_options: dict | None = None):
        """Yield tokens after the first until EOS / the cap / a base model's line break."""
        tokens = [first]
        plan = plan or ForwardPlan()
        stats["decode_policy"] = decode  # "full" = dense attention over the contiguous cache
        if decode != "full":
            options = dict(decode_options or {})
            diagnostic = options.pop("diagnostic", False)
            plan.decoder = self.make_decoder(cache, decode, kv_budget, prompt_ids=self._current_ids,
                                             diagnostic=diagnostic, **options)
            stats["kv_budget"] = plan.decoder.kv_budget
            cache.decoder = plan.decoder
        try:
            step = 0
            while tokens[-1] not in self.eos_ids and len(tokens) < max_new_tokens and not self._stop_text(tokens):
                step += 1
                if plan.decoder is None:
                    logits = self.forward(cache, torch.tensor([tokens[-1]]), torch.tensor([cache.length]), plan)
                else:
                    logits = self._decoder_step(cache, tokens[-1], plan)
                    plan.decoder.end_step()
                tokens.append(self._sample(logits[-1], temperature, top_p, seed, step))
                _sync(self.device)
                yield tokens[-1]
            if plan.decoder is not None:
                stats["decoder"] = plan.decoder.stats()
                if plan.decoder.diagnostic:
                    stats["decode_recall"] = plan.decoder.recall.summary()
        finally:
            cache.decoder = None

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
                             past_key_values=cache, use_cache=True, logits_to_keep=1, kvstitch_plan=plan)
        return out.logits[0].float()

    def _new_decoder(self, policy: str, kv_budget: int | None, options: dict | None = None):
        """An empty `SparseDecoder` sized for this model (``options``: see `stream`'s ``decode_options``)."""
        from .decode import make_decoder

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
                     diagnostic: bool = False, **options):
        """Hand the prefilled ``cache`` to a sparse decoder (PRKV & co.): every layer's K/V are copied to its
        host pool, so the cache itself is not modified and can seed several decoders. Static policies
        score with the observation window: ``obs_queries`` (from `observation_queries`), else computed
        from ``prompt_ids`` (the prompt's token ids). ``diagnostic``: record the attention recall of every
        step (``decoder.recall``); ``options``: see `stream`'s ``decode_options``."""
        dec = self._new_decoder(policy, kv_budget, {**options, "diagnostic": diagnostic})
        if obs_queries is None:
            if prompt_ids is None:
                raise InputError("make_decoder needs the prompt's token ids (prompt_ids) or obs_queries")
            obs_queries = self.observation_queries(cache, prompt_ids)
        n = cache.length
        ad = self.adapter
        layers = ad.backbone.layers
        for i, layer in enumerate(cache.layers):
            dec.load_prefill(i, layer.keys[0, :, :n], layer.values[0, :, :n], obs_queries[i],
                             sliding_window=ad.sliding_window(i), scaling=layers[i].self_attn.scaling)
        dec.diagnostic = diagnostic
        return dec
