"""The chat request: OpenAI's chat-completion body validated once, by a pydantic model (`ChatBody`, every
unknown or unsupported field a 400 naming it), into the typed `GenerationRequest` the engine runs; what a body
leaves out is the server's `ChatDefaults`. Imports pydantic (the 'serve' extra): the server imports it when
it starts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, Strict, StrictBool, StrictStr,
                      ValidationError, ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from kvstitch.core.errors import InputError
from kvstitch.core.prompt import normalize_messages
from kvstitch.decode.policies import DecodePolicy, make_policy, policy_budget
from kvstitch.engine.budget import AUTO, AutoBudget, split_ratio
from kvstitch.engine.request import GenerationRequest
from kvstitch.select import Selector, make_selector
from .jobs import ApiError, input_error
from .defaults import ChatDefaults

MAX_TOP_K = 64
MAX_STOP = 4
# OpenAI parameters this server takes only at their neutral value (anything else is a 400 naming them)
REFUSED = {"n": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logprobs": (None, False),
           "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
           "function_call": (None, "none"), "logit_bias": (None, {}), "response_format": (None, {"type": "text"}),
           "parallel_tool_calls": (None, False, True), "store": (None, False)}


def _integral(v):
    """JSON writes 8 as 8.0 at times: an integral float is the integer (a bool is not)."""
    return int(v) if type(v) is float and v.is_integer() else v


Int = Annotated[int, Strict(), BeforeValidator(_integral)]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def _bad(message: str, param: str | None, code: str = "invalid_request") -> PydanticCustomError:
    """A validation error that becomes exactly this 400 (`parse_chat_body`)."""
    return PydanticCustomError("chat", "{message}", {"message": message, "param": param, "code": code})


def _typed(e: InputError, message: str | None = None, param: str | None = None) -> PydanticCustomError:
    """An `InputError` of a reused parser as its 400 (its type sets code and param, as `input_error`)."""
    return _bad(message or str(e), param or e.param, e.code)


def _defaults(info: ValidationInfo) -> ChatDefaults:
    return (info.context or {})["defaults"]


class ChatBody(BaseModel):
    """A chat-completion body, validated: the fields in the order they are reported (the first bad one is the
    400), the method, ratio and decode policy as their objects, the server's defaults (validation context
    ``{"defaults": ChatDefaults}``) for those left out. `generation` is the engine's request."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    messages: list[dict] = Field(None, validate_default=True)  # normalized (`normalize_messages`)
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    logit_bias: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    store: Any = None
    user: StrictStr | None = None  # no effect on the output: accepted when well-formed
    metadata: dict | None = None
    model: Any = None
    stop: list[str] = Field(None, validate_default=True)
    documents: list[str] | None = None
    collection: str | None = None
    top_k: Annotated[Int, Field(ge=1, le=MAX_TOP_K)] = 4
    method: InstanceOf[Selector] = Field(None, validate_default=True)
    method_options: dict | None = None
    auto: InstanceOf[AutoBudget] | None = None
    ratio: float | str | InstanceOf[AutoBudget] | None = None  # "auto", or an auto spec's options (an object)
    recompute_ratio: float | str | InstanceOf[AutoBudget] | None = None
    guard: Literal["full"] | None = None  # "full": verify the answer against full prefill
    kv_budget: Annotated[Int, Field(ge=1)] | None = None
    decode: InstanceOf[DecodePolicy] = Field(None, validate_default=True)
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] = 0  # vLLM's: EOS masked until the answer has this many tokens
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Int = 0
    stream: StrictBool = False
    stream_options: dict | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v):
        if not isinstance(v, list) or not v:
            raise _bad("'messages' is required: a non-empty list of {role, content} objects", "messages")
        try:
            return normalize_messages(v)
        except InputError as e:
            raise _bad(str(e), "messages") from None

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refused(cls, v, info: ValidationInfo):
        if v not in REFUSED[info.field_name]:
            raise _bad(f"'{info.field_name}' is not supported by this server (value {v!r:.60})", info.field_name,
                       "unsupported_parameter")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        stop = [] if v is None else [v] if isinstance(v, str) else v
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP:
            raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
        return stop

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v):
        if v is None:
            return v
        if not isinstance(v, list) or not all(isinstance(d, str) for d in v):
            raise _bad("'documents' must be a list of strings (the passages)", "documents")
        if not v:
            raise _bad("'documents' is empty: pass at least one passage", "documents")
        for i, d in enumerate(v):
            if not d.strip():
                raise _bad(f"documents[{i}] is empty", "documents")
        return v

    @field_validator("collection", mode="before")
    @classmethod
    def _collection(cls, v):
        if v is not None and (not isinstance(v, str) or not v):
            raise _bad("'collection' must be a collection name (string)", "collection")
        return v

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, v, info: ValidationInfo):
        if v is None:
            v = _defaults(info).method
        if not isinstance(v, str):
            raise _bad(f"'method' must be a method spec (a string), got {v!r:.60}", "method")
        try:
            return make_selector(v)
        except InputError as e:
            raise _typed(e) from None

    @field_validator("auto", mode="before")
    @classmethod
    def _auto(cls, v):
        try:
            return None if v is None else AutoBudget.of(v)
        except InputError as e:
            raise _bad(f"'auto': {e}", "auto") from None

    @field_validator("ratio", "recompute_ratio", mode="before")
    @classmethod
    def _ratio(cls, v, info: ValidationInfo):
        """A fraction, "auto", or the options an auto spec carries ("auto(tol=0.05)" -> its `AutoBudget`)."""
        if v is None:
            return v
        try:
            ratio, carried = split_ratio(v)
        except InputError as e:
            raise _bad(f"'{info.field_name}': {e}", info.field_name) from None
        return carried if carried is not None else ratio

    @field_validator("guard", mode="before")
    @classmethod
    def _guard(cls, v):
        if v not in (None, "full"):
            raise _bad(f"'guard' must be \"full\" or absent, got {v!r:.60}", "guard")
        return v

    @field_validator("decode", mode="before")
    @classmethod
    def _decode(cls, v, info: ValidationInfo):
        defaults = _defaults(info)
        if v is None:
            v = defaults.decode
        if not isinstance(v, str):
            raise _bad(f"'decode' must be a decode policy spec (a string), got {v!r:.60}", "decode", "invalid_decode")
        try:
            policy = make_policy(v)
        except InputError as e:
            raise _typed(e) from None
        if defaults.policies is not None and policy.name not in defaults.policies:
            known = ", ".join(sorted(defaults.policies))
            raise _bad(f"decode policy {policy.name!r} is not served here; known: {known}", "decode", "invalid_decode")
        return policy

    @model_validator(mode="after")
    def _together(self, info: ValidationInfo):
        """The checks of fields together, once each field is valid on its own."""
        if self.documents is not None and self.collection is not None:
            raise _bad("pass either 'documents' or 'collection', not both", "collection")
        try:
            self.method = make_selector(self.method, **(self.method_options or {}))
            policy_budget(self.decode, self.kv_budget)  # two different budgets are an error
        except InputError as e:
            raise _typed(e) from None
        if self.documents is None and self.collection is None:
            self.method = make_selector("full")  # plain chat: nothing to stitch, an ordinary full prefill
        self._ratio_and_auto(_defaults(info))
        self._lengths(_defaults(info))
        return self

    def _ratio_and_auto(self, defaults: ChatDefaults) -> None:
        """``ratio`` (or ``recompute_ratio``) and ``auto`` as the engine takes them: a fraction or "auto", and the
        auto options (given, carried by an auto spec ratio, or None: the engine's default)."""
        if self.ratio is not None and self.recompute_ratio is not None:
            raise _bad("pass 'ratio' or 'recompute_ratio', not both", "ratio")
        name = "recompute_ratio" if self.recompute_ratio is not None else "ratio"
        given = self.recompute_ratio if self.recompute_ratio is not None else self.ratio
        try:
            self.ratio, self.auto = split_ratio(defaults.ratio if given is None else given, self.auto)
        except InputError as e:
            raise _bad(f"'{name}': {e}", name) from None
        self.recompute_ratio = None

    def _lengths(self, defaults: ChatDefaults) -> None:
        """``max_tokens`` (or OpenAI's newer ``max_completion_tokens``) and ``min_tokens`` below it."""
        mt, mct = self.max_tokens, self.max_completion_tokens
        if mt is not None and mct is not None and mt != mct:
            raise _bad("'max_tokens' and 'max_completion_tokens' disagree", "max_tokens")
        self.max_tokens = mct if mct is not None else mt if mt is not None else defaults.max_tokens
        if self.min_tokens > self.max_tokens:
            raise _bad(f"'min_tokens' must be <= {self.max_tokens}, got {self.min_tokens}", "min_tokens")

    # -- what the server reads ------------------------------------------------------------------
    @property
    def question(self) -> str:
        """The last user message (what retrieval searches with)."""
        return [m["content"] for m in self.messages if m["role"] == "user"][-1]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))

    def generation(self, chunks: list[str] | None, guard: str | None = None) -> GenerationRequest:
        """The engine's request over ``chunks`` (the passages given or retrieved), its fields the validated
        objects (``checked``: the engine does not check them again); ``guard`` as the server decided it. The
        body's ``auto`` and ``method_options`` are in ``recompute_ratio`` and ``method`` already, as
        `GenerationRequest` converts them (`kvstitch.engine.request.one_spelling`)."""
        ratio = self.auto if self.ratio == AUTO and self.auto is not None else self.ratio
        return GenerationRequest(
            messages=self.messages, chunks=chunks, method=self.method, recompute_ratio=ratio,
            max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            decode=self.decode, kv_budget=self.kv_budget, guard=guard or self.guard,
            min_new_tokens=self.min_tokens, checked=True)


def parse_chat_body(body, defaults: ChatDefaults) -> ChatBody:
    """The validated body, or a 400 `ApiError` naming its first bad field (`ChatBody`'s field order, unknown
    fields right after ``messages``)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_request")
    try:
        return ChatBody.model_validate(body, context={"defaults": defaults})
    except ValidationError as e:
        raise api_error(min(e.errors(include_url=False), key=_rank)) from None


_FIELDS = list(ChatBody.model_fields)


def _rank(err: dict) -> tuple[int, int]:
    name = err["loc"][0] if err["loc"] else None
    if err["type"] == "extra_forbidden":
        return 1, 0
    return (0 if name == "messages" else 2), (_FIELDS.index(name) if name in _FIELDS else len(_FIELDS))


_TYPE_WORDS = {"int": "an integer", "float": "a number", "finite": "a number", "bool": "a boolean",
               "string": "a string", "dict": "an object", "list": "a list"}
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def api_error(err: dict) -> ApiError:
    """One pydantic error as OpenAI's 400: ours (`_bad`) as they are; pydantic's own in words naming the field."""
    ctx, kind = err.get("ctx") or {}, err["type"]
    if kind == "chat":
        return ApiError(400, ctx["message"], code=ctx["code"], param=ctx["param"])
    name = str(err["loc"][0]) if err["loc"] else None
    if kind == "extra_forbidden":
        return ApiError(400, f"unsupported parameter {name!r:.60}: this server does not implement it (known: "
                             f"{', '.join(sorted(_FIELDS))})", code="unsupported_parameter", param=name)
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return ApiError(400, f"'{name}' must be {op} {ctx[key]}, got {err['input']!r:.60}", code="invalid_request",
                        param=name)
    word = _TYPE_WORDS.get(kind.split("_")[0])
    if word is not None:
        return ApiError(400, f"'{name}' must be {word}, got {err['input']!r:.60}", code="invalid_request", param=name)
    if kind == "value_error" and isinstance(ctx.get("error"), InputError):
        return input_error(ctx["error"])
    return ApiError(400, f"'{name}': {err['msg']}", code="invalid_request", param=name)
