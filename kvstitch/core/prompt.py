"""The prompt layout: shared prefix / chunks / suffix, tokenized piecewise and concatenated.

    prefix  = chat template up to the passages header (identical for every request: the attention sink
              every chunk is precomputed against)
    chunk_i = separator + passage text (or text + separator, whichever keeps seams clean)
    suffix  = question + end of turn + assistant header

The full-prefill baseline uses exactly these concatenated ids, so every method sees the same tokens.
The separator is chosen per tokenizer so that the piecewise ids also equal the joint tokenization of
the whole prompt (clean seams); `seam_exact` checks that.

Conversations (`PromptBuilder.build_messages`, OpenAI-style messages): the prompt is the model's own chat
template applied to every message, with the passages appended to the system message (after the system
prompt, before the conversation):

    prefix    = chat template up to the system content      (canonical: the same for every conversation)
    segment 0 = system prompt + DOCS_HEADER                 (a stitched segment with its own store key)
    chunk_i   = separator + passage text                    (the same ids as in the question layout)
    suffix    = end of the system turn + every later turn + the assistant header   (always recomputed)

Chunk caches are keyed by (canonical prefix, chunk ids), not by the system prompt, so one set of chunk
caches serves every system prompt; the system prompt is cached like a chunk (stored the first time, a
hit afterwards) and, sitting right after the prefix it was precomputed against, its cache is exact. The
suffix (history + last user turn + assistant header) is what query-driven selectors read as the query.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .errors import InputError

INSTRUCTION = ("Answer the question based on the given passages. "
               "Only give me the answer and do not output any other words.")
HEADER = "The following are given passages.\n\n"
DOCS_HEADER = "Use the following passages to answer the user's questions."  # conversations: after the system prompt
ROLES = ("system", "developer", "user", "assistant", "tool")
_CTX, _Q, _SYS = "\x00CTX\x00", "\x00Q\x00", "\x00SYS\x00"
# (where the separator goes, separator): leading separators keep BPE seams clean for GPT-2-style
# pre-tokenizers, which split "\n\nWord" as "\n", "\n", "Word" only when the newlines start the piece.
_SEPARATORS = (("lead", "\n\n"), ("trail", "\n\n"), ("lead", "\n"), ("trail", "\n"))
_PROBE = ["Alice lives in Paris. The sky is blue.", "Bob's number is 42, and 7 is lucky!", "(Another) passage: x=3"]


@dataclass
class PromptLayout:
    prefix_ids: torch.Tensor
    chunk_ids: list[torch.Tensor]
    suffix_ids: torch.Tensor
    order: list[int] = field(default_factory=list)  # chunk order used (identity unless reordered)
    pinned: int = 0  # leading chunks that must keep their place (a conversation's system segment)
    question: str | None = None  # the question text inside the suffix (methods that re-encode it: CacheClip)
    # the first ``links`` suffix ids are a stitch adapter's link tokens (`with_links`): recomputed like the
    # question, never part of a full prefill's prompt (`without_links`)
    links: int = 0

    def __post_init__(self):
        if not self.order:
            self.order = list(range(len(self.chunk_ids)))

    @property
    def n_prefix(self) -> int:
        return self.prefix_ids.numel()

    @property
    def n_context(self) -> int:
        return sum(c.numel() for c in self.chunk_ids)

    @property
    def n_suffix(self) -> int:
        return self.suffix_ids.numel()

    @property
    def n_total(self) -> int:
        return self.n_prefix + self.n_context + self.n_suffix

    @property
    def context_start(self) -> int:
        return self.n_prefix

    @property
    def context_end(self) -> int:
        return self.n_prefix + self.n_context

    @property
    def chunk_starts(self) -> list[int]:
        starts, pos = [], self.n_prefix
        for c in self.chunk_ids:
            starts.append(pos)
            pos += c.numel()
        return starts

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, *self.chunk_ids, self.suffix_ids])

    def chunk_index(self) -> torch.Tensor:
        """[n_context] chunk number of every context token (in layout order)."""
        return torch.cat([torch.full((c.numel(),), i, dtype=torch.long) for i, c in enumerate(self.chunk_ids)])

    def reordered(self, order: list[int]) -> "PromptLayout":
        if list(order[:self.pinned]) != list(range(self.pinned)):
            raise ValueError(f"the first {self.pinned} chunk(s) are pinned: order {order} moves them")
        return PromptLayout(self.prefix_ids, [self.chunk_ids[i] for i in order], self.suffix_ids,
                            [self.order[i] for i in order], self.pinned, self.question, self.links)

    def with_links(self, link_ids: torch.Tensor) -> "PromptLayout":
        """This layout with a stitch adapter's link tokens between the passages and the question."""
        if self.links:
            raise ValueError("the layout has link tokens already")
        return replace(self, suffix_ids=torch.cat([link_ids.to(self.suffix_ids.dtype), self.suffix_ids]),
                       links=link_ids.numel())

    def without_links(self) -> "PromptLayout":
        """The prompt as full prefill reads it: no link tokens."""
        return replace(self, suffix_ids=self.suffix_ids[self.links:], links=0) if self.links else self


def with_answer_prefix(layout: PromptLayout, tokenizer, answer_prefix: str | None) -> PromptLayout:
    """`layout` with an answer prefix (RULER's "The special magic number for X mentioned in the provided
    text is") appended after the assistant header. It belongs to the suffix, so query-driven selectors see
    it as part of the query. None or "" leaves the layout as it is."""
    if not answer_prefix:
        return layout
    extra = tokenizer.encode(answer_prefix.strip(), add_special_tokens=False)
    return replace(layout, suffix_ids=torch.cat([layout.suffix_ids, torch.tensor(extra, dtype=torch.long)]))


class PromptBuilder:
    """Turns (question, chunks) into a `PromptLayout` for one tokenizer."""

    def __init__(self, tokenizer, instruction: str = INSTRUCTION):
        self.tok = tokenizer
        self.instruction = instruction
        self._raw_prefix, self._raw_suffix = self._split_template()
        self.separator = next((s for s in _SEPARATORS if self._seams_ok(s)), _SEPARATORS[0])
        self.prefix_ids = self._encode(self.prefix_text, first=True)

    @property
    def prefix_text(self) -> str:
        return self._raw_prefix.rstrip() if self.separator[0] == "lead" else self._raw_prefix

    def _split_template(self) -> tuple[str, str]:
        user = f"{self.instruction}\n\n{HEADER}{_CTX}Question: {_Q}"
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                add_generation_prompt=True)
        else:  # base models (e.g. Gemma 3 270M): a plain completion prompt
            text = f"{user}\nAnswer:"
        prefix, rest = text.split(_CTX)
        return prefix, rest

    def _encode(self, text: str, first: bool = False) -> torch.Tensor:
        ids = self.tok.encode(text, add_special_tokens=first)
        bos = self.tok.bos_token_id
        if first and bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template already had BOS
        return torch.tensor(ids, dtype=torch.long)

    def chunk_piece(self, text: str) -> str:
        where, sep = self.separator
        return sep + text.strip() if where == "lead" else text.strip() + sep

    def encode_chunk(self, text: str) -> torch.Tensor:
        """The ids a chunk has inside any prompt (what the store keys and caches)."""
        return self._encode(self.chunk_piece(text))

    def suffix_text(self, question: str) -> str:
        where, sep = self.separator
        suffix = self._raw_suffix.replace(_Q, question.strip())
        return sep + suffix if where == "lead" else suffix

    def build(self, question: str, chunks: list[str]) -> PromptLayout:
        return PromptLayout(self._encode(self.prefix_text, first=True),
                            [self.encode_chunk(c) for c in chunks],
                            self._encode(self.suffix_text(question)), question=question.strip())

    def joint_ids(self, question: str, chunks: list[str]) -> torch.Tensor:
        text = self.prefix_text + "".join(self.chunk_piece(c) for c in chunks) + self.suffix_text(question)
        return self._encode(text, first=True)

    def seam_exact(self, question: str, chunks: list[str]) -> bool:
        return torch.equal(self.build(question, chunks).ids, self.joint_ids(question, chunks))

    def _seams_ok(self, sep: str) -> bool:
        old = getattr(self, "separator", None)
        self.separator = sep
        try:
            return self.seam_exact("Where does Alice live?", _PROBE)
        finally:
            self.separator = old


    # ---- conversations (OpenAI-style messages) ------------------------------------------------------
    def build_messages(self, messages: list[dict], chunks: list[str] | None = None) -> PromptLayout:
        """The layout of a conversation: the chat template over every message, the passages (``chunks``)
        appended to the system message (see the module docstring). Without passages and without a system
        prompt (plain chat) the whole prompt is one prefix token + the suffix: nothing to stitch."""
        msgs = normalize_messages(messages)
        chunks = check_chunks(chunks)
        system, rest = (msgs[0]["content"], msgs[1:]) if msgs[0]["role"] == "system" else (None, msgs)
        if not chunks and system is None:
            ids = self._encode(self.render(msgs), first=True)
            return PromptLayout(ids[:1], [], ids[1:])
        text = self.render([{"role": "system", "content": _SYS + (_CTX if chunks else "")}] + rest)
        if text.count(_SYS) != 1 or (chunks and text.count(_CTX) != 1) or _SYS + (_CTX if chunks else "") not in text:
            raise InputError("this model's chat template does not render a system message as given: "
                             "system prompts and passages cannot be placed")
        prefix, suffix = text.split(_SYS + (_CTX if chunks else ""))
        prefix_ids = self._encode(prefix, first=True)
        if prefix_ids.numel() == 0:
            raise InputError("the conversation prompt has no prefix token to start from (no BOS, no template)")
        return PromptLayout(prefix_ids, [self._encode(self.system_segment(system, bool(chunks)))]
                            + [self.encode_chunk(c) for c in chunks], self._encode(suffix), pinned=1,
                            question=next((m["content"] for m in reversed(msgs) if m["role"] == "user"), None))

    def system_segment(self, system: str | None, with_passages: bool) -> str:
        """The text of segment 0: the system prompt (stripped), then the passages header if any."""
        parts = [system.strip()] if system is not None and system.strip() else []
        if with_passages:
            parts.append(DOCS_HEADER)
        text = "\n\n".join(parts)
        if with_passages and self.separator[0] == "trail":
            text += self.separator[1]
        return text

    def conversation_messages(self, messages: list[dict], chunks: list[str] | None = None) -> list[dict]:
        """The messages the model sees: roles normalized, the passages appended to the system message
        (one is added when there is none). ``render`` of these is the text `build_messages` tokenizes."""
        msgs = normalize_messages(messages)
        chunks = check_chunks(chunks)
        system, rest = (msgs[0]["content"], msgs[1:]) if msgs[0]["role"] == "system" else (None, msgs)
        if not chunks and system is None:
            return msgs
        content = self.system_segment(system, bool(chunks)) + "".join(self.chunk_piece(c) for c in chunks)
        return [{"role": "system", "content": content}] + rest

    def render(self, msgs: list[dict]) -> str:
        """Chat template text (with the assistant header) of normalized messages; base models without a
        template get a plain "User: ... / Assistant:" transcript."""
        if not getattr(self.tok, "chat_template", None):
            out = []
            for m in msgs:
                out.append(m["content"] + "\n\n" if m["role"] == "system"
                           else f"{m['role'].capitalize()}: {m['content']}\n")
            return "".join(out) + "Assistant:"
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja raises many types (e.g. roles must alternate)
            if any(m["role"] == "tool" for m in msgs):  # templates without a tool role: results as user text
                return self.render([{"role": "user", "content": "Tool result:\n" + m["content"]}
                                    if m["role"] == "tool" else m for m in msgs])
            raise InputError(f"this model's chat template rejected the conversation: {e}") from None

    def chat_prefix_ids(self) -> torch.Tensor:
        """The canonical prefix conversations with passages start with (what their chunks are keyed by)."""
        return self.build_messages([{"role": "user", "content": "?"}], ["?"]).prefix_ids

    def canonical_prefixes(self) -> list[torch.Tensor]:
        """Every prefix chunks are precomputed after: the question layout's and the conversation layout's."""
        out = [self.prefix_ids]
        try:
            chat = self.chat_prefix_ids()
        except InputError:
            return out
        return out if torch.equal(chat, self.prefix_ids) else out + [chat]


def message_text(content, where: str) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise InputError(f"{where}: only text content parts are supported")
        return "\n".join(parts)
    raise InputError(f"{where}: 'content' must be a string or a list of text parts")


def normalize_messages(messages) -> list[dict]:
    """Validate OpenAI-style messages -> ``[{"role", "content": str}]``: ``developer`` becomes ``system``,
    an assistant's ``tool_calls`` are written out as text, tool results stay ``tool`` messages (text)."""
    if not isinstance(messages, list) or not messages:
        raise InputError("'messages' must be a non-empty list of {role, content} objects")
    out, last_user = [], None
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"{where} must be an object with a 'role' and a 'content'")
        role = m["role"]
        if role not in ROLES:
            raise InputError(f"{where}: unknown role {role!r:.40}; known: {', '.join(ROLES)}")
        content = m.get("content")
        if role == "assistant" and content is None:
            content = ""
        text = message_text(content, where)
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise InputError(f"{where}: 'tool_calls' must be a list")
            for c in calls:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                text += f"\n[tool call] {fn.get('name', '?')}({fn.get('arguments', '')})"
        if "\x00" in text:
            raise InputError(f"{where}: content contains a NUL character")
        if role == "user":
            last_user = text
        out.append({"role": "system" if role == "developer" else role, "content": text})
    if last_user is None:
        raise InputError("no 'user' message: a conversation needs at least one")
    if not last_user.strip():
        raise InputError("the last user message is empty")
    return out


def last_user_text(messages: list[dict]) -> str:
    """The content of the last user message (what retrieval searches with)."""
    return [m for m in normalize_messages(messages) if m["role"] == "user"][-1]["content"]


def check_chunks(chunks) -> list[str]:
    if chunks is None:
        return []
    if not isinstance(chunks, (list, tuple)):
        raise InputError("chunks must be a list of passage strings")
    for i, c in enumerate(chunks):
        if not isinstance(c, str) or not c.strip():
            raise InputError(f"chunk {i} is empty")
    return list(chunks)
