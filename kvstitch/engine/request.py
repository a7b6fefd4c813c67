"""A request and what it becomes: `GenerationRequest` (what a user asks), its one validation
(`check_request`, before anything is computed), the `Prefill` a prefill leaves for decoding, and the
`GenerationResult`."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch

from kvstitch.core.cache import StitchCache
from kvstitch.core.errors import BadMethodOption, InputError, KVStitchDeprecationWarning, PromptTooLong
from kvstitch.core.options import option_fields
from kvstitch.core.prompt import PromptBuilder, PromptLayout
from kvstitch.decode.policies import DecodePolicy, make_policy, policy_budget
from kvstitch.select import Selector, make_selector
from .budget import AutoBudget, join_ratio, split_ratio
from .stats import GenerationStats

# kvstitch's own method over InfoFlow's selection: on the tuning splits it recovers more of the gap to full prefill
# than prophet, infoflow, qcfuse or deltaprop over prophet, at about infoflow's cost (docs/results/own-method,
# docs/results/squad)
DEFAULT_METHOD = "deltaprop(base=infoflow)"
STOP = object()  # `stream(...).send(STOP)`: end the generation after the token just yielded (stop sequences)


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
    # stable, with the engine's default options, or with these: ``AutoBudget(tol=0.05)`` / "auto(tol=0.05)"
    # (see `kvstitch.engine.budget`)
    recompute_ratio: float | str | AutoBudget = 0.2
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # of the sampling (temperature > 0)
    # "dense" (alias "full") or a sparse policy over ``kv_budget`` tokens: a name (prkv, quest, snapkv, arkvale,
    # shadowkv), a spec ("prkv(static_ratio=0.5)") or an object (``PRKV(kv_budget=512)``), see `kvstitch.decode`
    decode: str | DecodePolicy = "dense"
    # the budget of a policy whose spec gives none (one budget for several policies; None: 1024); a policy's own
    # ``kv_budget`` wins, and the two differing is an error
    kv_budget: int | None = None
    auto: AutoBudget | dict | None = None  # deprecated: recompute_ratio=AutoBudget(...) (None once built)
    # "full": verify the greedy answer against full prefill (full prefill's answer is returned when they differ)
    guard: str | None = None
    method_options: dict | None = None  # deprecated: the options in the method spec (None once built)
    # of the sparse decoder: ``diagnostic=True`` records attention recall (``stats.decode_recall``), ``page_size``,
    # ``device_pages`` (`kvstitch.decode.make_decoder`); fields of the policy here are deprecated (the decode spec)
    decode_options: dict | None = None
    min_new_tokens: int = 0  # EOS is masked until the answer has this many tokens (vLLM's min_tokens; benches)
    layout: PromptLayout | None = None  # a prompt laid out already (`Engine.layout`) instead of question + chunks
    # True: the caller validated every field into its object (``method`` a `Selector`, ``decode`` a
    # `DecodePolicy`, ``recompute_ratio`` a fraction, "auto" or an `AutoBudget`, see `kvstitch.serve.schema`);
    # `check_request` then runs only the checks that need the engine
    checked: bool = field(default=False, metadata={"internal": True})  # not a user's option: generate() omits it

    def __post_init__(self):
        one_spelling(self)


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
class Prefill:
    """A prefilled request, ready to decode: everything per-request lives here (the engine is reentrant)."""

    cache: StitchCache  # with room for the answer
    layout: PromptLayout  # the layout used (a selector may have reordered the chunks)
    logits: torch.Tensor  # [q, V] suffix logits of the last pass; row -1 predicts the first answer token
    indices: torch.Tensor  # context indices whose K/V were recomputed
    stats: dict  # what prefill measured, selectors' keys included (the result types it: `GenerationStats`)
    selector: object  # the method's `Selector` (its decode plan applies after the first token)
    greedy: list[int] = field(default_factory=list)  # answer tokens an adaptive prefill already computed


@dataclass
class CheckedRequest:
    """A request that passed `check_request`: its prompt, its method object, its parsed ratio (with the auto
    options, when the ratio carries them) and its decode policy object."""

    layout: PromptLayout
    selector: Selector
    ratio: float | str  # a fraction, or "auto"
    auto: AutoBudget | dict | None = None  # options of "auto" (None: the engine's default_auto)
    decode: DecodePolicy | None = None


def build_layout(builder: PromptBuilder, question: str | None, chunks: list[str] | None,
                 messages: list[dict] | None = None) -> PromptLayout:
    """The prompt of a question over chunks, or of a conversation; empty or missing parts are an InputError."""
    if messages is not None:  # a conversation: see `PromptBuilder.build_messages`
        if question is not None:
            raise InputError("pass either a question or messages, not both")
        return builder.build_messages(messages, chunks)
    if question is None:
        raise InputError("pass a question or messages")
    if not isinstance(question, str) or not question.strip():
        raise InputError("the question is empty")
    if not chunks:
        raise InputError("no chunks given: pass at least one passage")
    for i, c in enumerate(chunks):
        if not isinstance(c, str) or not c.strip():
            raise InputError(f"chunk {i} is empty")
    return builder.build(question, chunks)


def check_request(engine, req: GenerationRequest, selector: Selector | None = None) -> CheckedRequest:
    """The one validation of a request (every entry point runs it before anything is computed): typed
    InputErrors for a bad prompt, method, ratio, decode policy, length or option. ``selector``: a ready method
    object to use instead of parsing ``req.method`` (the eval harness memoises its scores). A ``checked``
    request's fields are taken as they are: only the prompt and what depends on the engine are checked."""
    layout = req.layout or build_layout(engine.builder, req.question, req.chunks, req.messages)
    selector = selector or (req.method if req.checked else make_selector(req.method))
    ratio, auto = split_ratio(req.recompute_ratio)  # an auto budget: "auto" and its options
    policy = check_decode(engine, req.decode, req.kv_budget, req.decode_options, budget_checked=req.checked)
    if not req.checked:
        _check_fields(req)
    limit = engine.adapter.max_positions
    if layout.n_total + req.max_new_tokens > limit:
        raise PromptTooLong(f"prompt is {layout.n_total} tokens + {req.max_new_tokens} new tokens > the model's "
                            f"limit of {limit} positions; pass fewer or shorter chunks (nothing is truncated)")
    if not policy.select_all() and selector.adjusts_decode():
        raise InputError(f"method {selector.label!r} changes decode attention (APE scaling / A3 eviction); a "
                         f"sparse decoder ({policy.spec!r}) would silently drop that: use decode='dense'")
    return CheckedRequest(layout, selector, ratio, auto, policy)


def one_spelling(req: GenerationRequest) -> None:
    """The deprecated keywords of a request converted, where it is built, into the one spelling of each setting,
    each with a `KVStitchDeprecationWarning`: ``auto`` into ``recompute_ratio`` (an `AutoBudget`),
    ``method_options`` into ``method`` (the method object), fields of the policy in ``decode_options`` into
    ``decode``."""
    if req.auto is not None:
        _deprecated("auto=", "recompute_ratio=AutoBudget(...) or 'auto(tol=0.05)'")
        req.recompute_ratio, req.auto = join_ratio(req.recompute_ratio, req.auto), None
    if req.method_options is not None:
        _deprecated("method_options=", "the options in the method spec, e.g. method='deltaprop(alpha_k=0.5)'")
        if not isinstance(req.method_options, dict):
            raise BadMethodOption(f"method_options must be a dict, got {req.method_options!r:.60}")
        req.method, req.method_options = make_selector(req.method, **req.method_options), None
    if isinstance(req.decode_options, dict) and req.decode_options:
        policy = make_policy(req.decode)
        fields = {f.name for f in option_fields(type(policy))} & set(req.decode_options)
        if fields and not policy.select_all():  # dense takes no decode_options at all (`check_decode`)
            _deprecated("decode_options with fields of the decode policy", "them in the decode spec, e.g. "
                        "decode='prkv(window=32)'")
            req.decode = make_policy(policy, **{k: req.decode_options[k] for k in fields})
            req.decode_options = {k: v for k, v in req.decode_options.items() if k not in fields} or None


def _deprecated(old: str, new: str) -> None:
    """A `KVStitchDeprecationWarning` attributed to the first caller outside kvstitch (where the keyword was written:
    Python shows it there by default)."""
    depth, frame = 1, sys._getframe(1)
    # frames of kvstitch, of the dataclass's generated __init__ and of torch.no_grad's wrapper of `Engine.generate`
    while frame.f_back is not None and (frame.f_globals.get("__name__", "").startswith(("kvstitch.", "torch."))
                                        or frame.f_code.co_filename == "<string>"):
        depth, frame = depth + 1, frame.f_back
    warnings.warn(f"{old} is deprecated: pass {new}", KVStitchDeprecationWarning, stacklevel=depth + 1)


def _check_fields(req: GenerationRequest) -> None:
    """The plain fields of a request that did not come validated."""
    if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {req.max_new_tokens!r}")
    if req.guard not in (None, "full"):
        raise InputError(f"guard must be None or 'full', got {req.guard!r}")
    if isinstance(req.min_new_tokens, bool) or not isinstance(req.min_new_tokens, int) or req.min_new_tokens < 0:
        raise InputError(f"min_new_tokens must be an integer >= 0, got {req.min_new_tokens!r}")


def new_decoder(engine, policy: str | DecodePolicy, kv_budget: int | None, options: dict | None = None):
    """An empty `SparseDecoder` sized for the engine's model (``options``: `GenerationRequest.decode_options`;
    the budget: `kvstitch.decode.policy_budget`)."""
    from kvstitch.decode import make_decoder

    options = dict(options or {})
    if not isinstance(options.pop("diagnostic", False), bool):
        raise InputError("decode option 'diagnostic' must be true or false")
    ad = engine.adapter
    return make_decoder(policy, kv_budget, num_layers=ad.num_layers, num_q_heads=ad.num_q_heads,
                        num_kv_heads=ad.num_kv_heads, head_dim=ad.head_dim, device=engine.device, dtype=engine.dtype,
                        **options)


def check_decode(engine, decode, kv_budget: int | None, decode_options: dict | None,
                 budget_checked: bool = False) -> DecodePolicy:
    """The decode policy (a name, spec or object -> the object), its budget (unless ``budget_checked``) and
    options (a sparse decoder is built once, empty, to check them: a budget too small for it fails here)."""
    policy = make_policy(decode)
    if not budget_checked:  # a bad budget, or two different ones, whatever the policy
        policy_budget(policy, kv_budget)
    if decode_options is not None and (policy.select_all() or not isinstance(decode_options, dict)):
        raise InputError("decode_options (a dict) configure a sparse decoder; decode='dense' takes none")
    if not policy.select_all():
        new_decoder(engine, policy, kv_budget, decode_options)  # bad options / a too-small budget fail here
    return policy
