"""The chat request: OpenAI's chat-completion body checked field by field into a `ChatRequest` (every
unknown or unsupported field a 400 naming it), and the server's defaults for it."""

import math
from dataclasses import dataclass

from kvstitch.core.errors import InputError
from kvstitch.core.prompt import normalize_messages
from kvstitch.decode.policies import make_policy, policy_budget
from kvstitch.engine.budget import AutoBudget, split_ratio
from kvstitch.select import make_selector
from .core import ApiError, input_error

DEFAULT_MAX_TOKENS = 256
MAX_TOP_K = 64
MAX_STOP = 4
# every request field this server understands (anything else is a 400 naming it): OpenAI's, then ours
CHAT_PARAMS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
               "stream_options", "stop", "n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
               "tools", "functions", "tool_choice", "function_call", "response_format", "logit_bias", "user",
               "metadata", "store", "parallel_tool_calls",
               "documents", "collection", "top_k", "method", "ratio", "recompute_ratio", "decode", "kv_budget",
               "method_options", "guard", "auto", "min_tokens"}


@dataclass
class ChatRequest:
    question: str  # the last user message (what retrieval searches with)
    messages: list[dict]  # the whole conversation (normalized, see `kvstitch.core.prompt.normalize_messages`)
    stop: list[str]
    documents: list[str] | None
    collection: str | None
    top_k: int
    method: str  # the method's label (an alias, or its canonical spec: every option in it)
    ratio: float | str  # a fraction, or "auto" (kvstitch.engine.budget)
    decode: str  # the decode policy's canonical spec ("dense", "prkv(static_ratio=0.5)")
    kv_budget: int | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool
    model: str | None
    guard: str | None = None  # "full": verify the answer against full prefill
    auto: AutoBudget | dict | None = None  # options of ratio "auto" (given, or carried by an auto spec ratio)
    min_tokens: int = 0  # EOS masked until the answer has this many tokens


def _bad(msg: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, msg, code=code, param=param)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(f"'{name}' must be an integer, got {v!r:.60}", name)
    v = int(v)
    if lo is not None and v < lo:
        raise _bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _float(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise _bad(f"'{name}' must be a number, got {v!r:.60}", name)
    if not lo <= v <= hi:
        raise _bad(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
    return float(v)


def parse_chat_request(body, default_method: str, default_ratio: float | str, default_decode: str,
                       default_max_tokens: int, decode_policies: set[str] | None = None) -> ChatRequest:
    """The checked request (a 400 `ApiError` naming the first bad field), its fields checked in this order:
    messages, unknown and unsupported parameters, stop, passages, method settings, sampling, streaming.
    ``decode_policies``: the policy names this server offers (None: every registered one)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    question, messages = _messages(body)
    _refuse_unsupported(body)
    stop = _stop(body)
    documents, collection, top_k = _passages(body)
    method, ratio, guard, auto, decode, kv_budget = _method_settings(body, default_method, default_ratio,
                                                                     default_decode, decode_policies)
    max_tokens, min_tokens, temperature, top_p, seed = _sampling(body, default_max_tokens)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    if documents is None and collection is None:
        method = "full"  # plain chat: nothing to stitch, an ordinary full prefill
    return ChatRequest(question=question, messages=messages, stop=stop, documents=documents, collection=collection,
                       top_k=top_k, method=method,
                       ratio=ratio, decode=decode, kv_budget=kv_budget,
                       max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stream=stream,
                       include_usage=bool(opts.get("include_usage", False)),
                       model=model if isinstance(model, str) else None, guard=guard,
                       auto=auto, min_tokens=min_tokens)


def _messages(body: dict) -> tuple[str, list[dict]]:
    """(the last user message, the normalized conversation)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' is required: a non-empty list of {role, content} objects", "messages")
    try:
        messages = normalize_messages(msgs)
    except InputError as e:
        raise _bad(str(e), "messages") from None
    return [m["content"] for m in messages if m["role"] == "user"][-1], messages


def _refuse_unsupported(body: dict) -> None:
    """A 400 for an unknown field or an OpenAI parameter set to a value this server does not implement."""
    unknown = sorted(k for k in body if k not in CHAT_PARAMS)
    if unknown:
        raise _bad(f"unsupported parameter {unknown[0]!r:.60}: this server does not implement it (known: "
                   f"{', '.join(sorted(CHAT_PARAMS))})", unknown[0], code="unsupported_parameter")
    for name, ok in (("n", lambda v: v in (None, 1)), ("presence_penalty", lambda v: v in (None, 0)),
                     ("frequency_penalty", lambda v: v in (None, 0)), ("logprobs", lambda v: v in (None, False)),
                     ("top_logprobs", lambda v: v in (None, 0)), ("tools", lambda v: v in (None, [])),
                     ("functions", lambda v: v in (None, [])), ("tool_choice", lambda v: v in (None, "none")),
                     ("function_call", lambda v: v in (None, "none")), ("logit_bias", lambda v: v in (None, {})),
                     ("response_format", lambda v: v in (None, {"type": "text"})),
                     ("parallel_tool_calls", lambda v: v in (None, False, True)),
                     ("store", lambda v: v in (None, False))):
        if not ok(body.get(name)):
            raise _bad(f"'{name}' is not supported by this server (value {body.get(name)!r:.60})", name,
                       code="unsupported_parameter")
    for name in ("user", "metadata"):  # no effect on the output: accepted when well-formed
        if body.get(name) is not None and not isinstance(body[name], (str if name == "user" else dict)):
            raise _bad(f"'{name}' must be a {'string' if name == 'user' else 'object'}", name)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP:
        raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return stop


def _passages(body: dict) -> tuple[list[str] | None, str | None, int]:
    """(documents, collection, top_k): the passages given, or the collection to retrieve them from."""
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise _bad("'documents' must be a list of strings (the passages)", "documents")
        if not documents:
            raise _bad("'documents' is empty: pass at least one passage", "documents")
        for i, d in enumerate(documents):
            if not d.strip():
                raise _bad(f"documents[{i}] is empty", "documents")
    collection = body.get("collection")
    if collection is not None and (not isinstance(collection, str) or not collection):
        raise _bad("'collection' must be a collection name (string)", "collection")
    if documents is not None and collection is not None:
        raise _bad("pass either 'documents' or 'collection', not both", "collection")
    return documents, collection, _int(body, "top_k", 4, 1, MAX_TOP_K)


def _method_settings(body: dict, default_method: str, default_ratio: float | str, default_decode: str,
                     decode_policies: set[str] | None) -> tuple:
    """(method label, ratio, guard, auto, decode spec, kv_budget)."""
    method = body.get("method", default_method)
    if not isinstance(method, str):
        raise _bad(f"'method' must be a method spec (a string), got {method!r:.60}", "method")
    method_options = body.get("method_options")
    if method_options is not None and not isinstance(method_options, dict):
        raise _bad("'method_options' must be an object", "method_options")
    try:  # the label carries every option: the engine parses it back to the same object
        method = make_selector(method, **(method_options or {})).label
    except InputError as e:
        raise input_error(e) from None
    if "ratio" in body and "recompute_ratio" in body:
        raise _bad("pass 'ratio' or 'recompute_ratio', not both", "ratio")
    auto = body.get("auto")
    if auto is not None:
        try:
            auto = AutoBudget.of(auto)
        except InputError as e:
            raise _bad(f"'auto': {e}", "auto") from None
    ratio_name = "ratio" if "ratio" in body else "recompute_ratio"
    try:  # an auto spec ("auto(tol=0.05)") carries its options: (ratio "auto", those options)
        ratio, auto = split_ratio(body.get(ratio_name, default_ratio), auto)
    except InputError as e:
        raise _bad(f"'{ratio_name}': {e}", ratio_name) from None
    guard = body.get("guard")
    if guard not in (None, "full"):
        raise _bad(f"'guard' must be \"full\" or absent, got {guard!r:.60}", "guard")
    decode, kv_budget = _decode_settings(body, default_decode, decode_policies)
    return method, ratio, guard, auto, decode, kv_budget


def _decode_settings(body: dict, default_decode: str, decode_policies: set[str] | None) -> tuple[str, int | None]:
    """(the decode policy's canonical spec, kv_budget): a name, an alias or a spec string."""
    decode = body.get("decode", default_decode)
    kv_budget = _int(body, "kv_budget", None, 1)
    if not isinstance(decode, str):
        raise _bad(f"'decode' must be a decode policy spec (a string), got {decode!r:.60}", "decode", "invalid_decode")
    try:
        policy = make_policy(decode)
        policy_budget(policy, kv_budget)  # two different budgets are an error
    except InputError as e:
        raise input_error(e) from None
    if decode_policies is not None and policy.name not in decode_policies:
        raise _bad(f"decode policy {policy.name!r} is not served here; known: {', '.join(sorted(decode_policies))}",
                   "decode", "invalid_decode")
    return policy.spec, kv_budget


def _sampling(body: dict, default_max_tokens: int) -> tuple[int, int, float, float, int]:
    """(max_tokens, min_tokens, temperature, top_p, seed)."""
    if "max_tokens" in body and "max_completion_tokens" in body and \
            body["max_tokens"] != body["max_completion_tokens"]:
        raise _bad("'max_tokens' and 'max_completion_tokens' disagree", "max_tokens")
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt_name, default_max_tokens, 1)
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)  # vLLM's: no EOS before this many tokens
    temperature = _float(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("'top_p' must be > 0", "top_p")
    return max_tokens, min_tokens, temperature, top_p, _int(body, "seed", 0)


def decode_policies() -> set[str]:
    """The registered decode policy names (`kvstitch.decode`; the alias ``full`` is accepted too)."""
    from kvstitch.decode import DECODE_POLICIES

    return set(DECODE_POLICIES)
