"""Decoding after a prefill: sampling, the stop rules, dense steps over the contiguous cache or sparse ones
through a paged decoder (`kvstitch.decode`), and the answer's text and result.

The functions take the `Engine` as their first argument and reach it through its public members.
"""

from __future__ import annotations

import time

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import InputError
from kvstitch.decode.policies import DecodePolicy, make_policy
from kvstitch.models import cache_kwargs
from kvstitch.models.stitch_adapter import gate_of, gated
from .batch import DecodeStep
from .sampling import answer_text, finished, sample
from .request import STOP, GenerationRequest, GenerationResult, Prefill, new_decoder
from .stats import GenerationStats


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (stage times measure the work, not its launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_result(engine, pre: Prefill, tokens: list[int], tpot: float) -> GenerationResult:
    """The `GenerationResult` of ``tokens`` decoded after ``pre`` (its stats typed)."""
    stats = pre.stats
    stats.update(recomputed_tokens=int(pre.indices.numel()), order=pre.layout.order, decode_tokens=len(tokens),
                 tpot_s=tpot)
    stats.setdefault("ratio_used", pre.indices.numel() / max(pre.layout.n_context, 1))
    typed = GenerationStats.from_dict(stats)
    return GenerationResult(text=answer_text(engine, tokens), ttft_s=typed.ttft_s, recomputed=pre.indices.tolist(),
                            stats=typed, token_ids=tokens, first_logits=pre.logits[-1].cpu(), method=typed.method)


# ---- the decode loop ---------------------------------------------------------------------------------------
def first_tokens(engine, pre: Prefill, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                 min_new_tokens: int) -> list[int]:
    """The answer's first token(s): those an adaptive prefill already computed greedily (their K/V in the
    cache), else one sampled from the prefill's logits."""
    n = pre.layout.n_total
    if pre.greedy and temperature <= 0:
        tokens = list(pre.greedy[:max_new_tokens])
        if len(tokens) < len(pre.greedy):
            pre.cache.truncate(n + len(tokens) - 1)
        return tokens
    pre.cache.truncate(n)  # sampling: the greedy probe's K/V (if any) are not this answer's
    return [sample(engine, pre.logits[-1], temperature, top_p, seed, no_eos=min_new_tokens > 0)]


def decode_plan(engine, pre: Prefill, decode: str | DecodePolicy, kv_budget: int | None,
                decode_options: dict | None, plan: ForwardPlan | None, batch_steps: bool,
                reserve: int) -> tuple[ForwardPlan, bool]:
    """The plan of the steps after the first token: ``plan``, else the method's decode plan, else plain; a
    sparse ``decode`` policy gets its decoder (`make_decoder`) -> (plan, whether steps can be batched)."""
    stats, cache = pre.stats, pre.cache
    custom = plan or pre.selector.decode_plan(engine, cache, pre.layout, stats)
    plan = custom or ForwardPlan()
    batchable = batch_steps and custom is None  # dense, or through a sparse decoder (`decode_batch`)
    stats["batched_decode"] = batchable
    policy = make_policy(decode)
    stats["decode_policy"] = policy.spec  # "dense": attention over the contiguous cache, no decoder
    if not policy.select_all():
        options = dict(decode_options or {})
        diagnostic = options.pop("diagnostic", False)
        plan.decoder = make_decoder(engine, cache, policy, kv_budget, prompt_ids=pre.layout.ids,
                                           diagnostic=diagnostic, reserve_tokens=reserve,
                                           release=batch_steps, **options)
        stats["decode_policy"] = plan.decoder.policy.spec  # decode_options may set policy fields
        stats["kv_budget"] = plan.decoder.kv_budget
        cache.decoder = plan.decoder
    return plan, batchable


@torch.no_grad()
def decode_tokens(engine, pre: Prefill, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                  seed: int = 0, decode: str | DecodePolicy = "dense", kv_budget: int | None = None,
                  decode_options: dict | None = None, plan: ForwardPlan | None = None,
                  batch_steps: bool = False, min_new_tokens: int = 0):
    """Yield the answer's tokens after ``pre`` (see `Engine.decode_tokens`)."""
    tokens = first_tokens(engine, pre, max_new_tokens, temperature, top_p, seed, min_new_tokens)
    yield from tokens

    def done() -> bool:
        return len(tokens) >= max_new_tokens or (len(tokens) >= min_new_tokens and finished(engine, tokens))

    if done():
        return
    cache = pre.cache
    plan, batchable = decode_plan(engine, pre, decode, kv_budget, decode_options, plan, batch_steps, max_new_tokens)
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
                logits = engine.forward(cache, torch.tensor([tokens[-1]]), torch.tensor([cache.length]), plan)
            else:
                logits = decoder_step(engine, cache, tokens[-1], plan)
                plan.decoder.end_step()
            tokens.append(sample(engine, logits[-1], temperature, top_p, seed, step,
                                 no_eos=len(tokens) < min_new_tokens))
            sync(engine.device)
            yield tokens[-1]
        if plan.decoder is not None:
            pre.stats["decoder"] = plan.decoder.stats()
            if plan.decoder.diagnostic:
                pre.stats["decode_recall"] = plan.decoder.recall.summary()
    finally:
        cache.decoder = None


# ---- sparse decoders ---------------------------------------------------------------------------------------
def decoder_step(engine, cache: StitchCache, token: int, plan: ForwardPlan) -> torch.Tensor:
    """One step through ``plan.decoder`` (which owns the K/V; ``cache`` counts the length) -> logits [1, V]."""
    pos = torch.tensor([[cache.length]], device=engine.device)
    with cache.mode(slots=None), gated(gate_of(torch.tensor([float(cache.adapted)]))):
        out = engine.model(input_ids=torch.tensor([[token]], device=engine.device), position_ids=pos,
                           **cache_kwargs(engine.model, cache), use_cache=True, logits_to_keep=1, kvstitch_plan=plan)
    return out.logits[0].float()


@torch.no_grad()
def decode_step(engine, cache: StitchCache, token: int, decoder=None) -> torch.Tensor:
    """One decode step, dense or through ``decoder`` (see `Engine.decode_step`) -> logits [1, V]."""
    if decoder is None:
        return engine.forward(cache, torch.tensor([token]), torch.tensor([cache.length]))
    plan = ForwardPlan(decoder=decoder)
    cache.decoder = decoder
    try:
        logits = decoder_step(engine, cache, token, plan)
    finally:
        cache.decoder = None
    decoder.end_step()
    return logits


@torch.no_grad()
def observation_queries(engine, cache: StitchCache, prompt_ids: torch.Tensor, window: int = 32) -> dict:
    """Post-RoPE queries ``{layer: [Hq, w, D]}`` of the last ``window`` prompt tokens, re-run out of place."""
    n = cache.length
    if prompt_ids.numel() != n:
        raise InputError(f"the cache holds {n} tokens but the prompt has {prompt_ids.numel()}")
    w = min(window, n)
    plan = ForwardPlan(capture_queries=w)
    engine.forward(cache, prompt_ids[n - w:n], torch.arange(n - w, n), plan, write=False)
    return plan.queries


@torch.no_grad()
def make_decoder(engine, cache: StitchCache, policy: str | DecodePolicy, kv_budget: int | None = None, *,
                 prompt_ids: torch.Tensor | None = None, obs_queries: dict | None = None, diagnostic: bool = False,
                 reserve_tokens: int | None = None, release: bool = False, **options):
    """Hand the prefilled ``cache`` to a sparse decoder (see `Engine.make_decoder`)."""
    dec = new_decoder(engine, policy, kv_budget, {**options, "diagnostic": diagnostic})
    if reserve_tokens is not None:
        dec.reserve_tokens = reserve_tokens
    if obs_queries is None:
        if prompt_ids is None:
            raise InputError("make_decoder needs the prompt's token ids (prompt_ids) or obs_queries")
        obs_queries = observation_queries(engine, cache, prompt_ids, window=dec.window)  # = the local window
    n = cache.length
    ad = engine.adapter
    layers = ad.backbone.layers
    for i, layer in enumerate(cache.layers):
        dec.load_prefill(i, layer.keys[0, :, :n], layer.values[0, :, :n], obs_queries[i],
                         sliding_window=ad.sliding_window(i), scaling=layers[i].self_attn.scaling,
                         inv_freq=ad.inv_freq(i))
        if release:
            layer.keys, layer.values = layer.keys[:, :, :0].clone(), layer.values[:, :, :0].clone()
    dec.diagnostic = diagnostic
    return dec


def stream_answer(engine, req: GenerationRequest, pre: Prefill, t_start: float, batch_decode: bool = False):
    """Yield the answer's tokens (and, with ``batch_decode``, its `DecodeStep`s, taking their logits back), then
    its `GenerationResult`. A consumer that sends `STOP` ends the answer after the token just yielded."""
    tokens: list[int] = []
    steps = decode_tokens(engine, pre, req.max_new_tokens, req.temperature, req.top_p, req.seed, req.decode,
                          req.kv_budget, req.decode_options, batch_steps=batch_decode,
                          min_new_tokens=req.min_new_tokens)
    back, t0 = None, time.perf_counter()
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
            pre.stats["ttft_s"] = time.perf_counter() - t_start
            t0 = time.perf_counter()
        tokens.append(tok)
        if (yield tok) is STOP:  # a stop sequence: end after this token, still report the result
            steps.close()
            break
    yield make_result(engine, pre, tokens, (time.perf_counter() - t0) / max(len(tokens) - 1, 1))
