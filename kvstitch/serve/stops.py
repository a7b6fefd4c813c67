"""Stop strings over a token stream: where the first one starts (`StopScanner`, which ends a generation on
the engine worker) and the text a stream may send so far (`TextStream`, the SSE deltas)."""

from kvstitch.engine import GenerationResult


def first_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text``, or None."""
    hits = [(text.find(s), s) for s in stop if s in text]
    return min(hits) if hits else None


def partial_stop(text: str, stop: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (held back)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopScanner:
    """Watches the generated text for stop strings (the engine worker ends the generation at the first)
    and cuts the final text before it."""

    def __init__(self, tokenizer, eos_ids, stop: list[str]):
        self.tok, self.eos, self.stop = tokenizer, set(eos_ids), list(stop)
        self.ids: list[int] = []
        self.hit: str | None = None

    def push(self, token: int) -> bool:
        if token not in self.eos:
            self.ids.append(token)
        if self.hit is None:
            found = first_stop(self.tok.decode(self.ids, skip_special_tokens=True).lstrip(), self.stop)
            self.hit = found[1] if found else None
        return self.hit is not None

    def apply(self, res: GenerationResult) -> GenerationResult:
        if self.hit is None:
            return res
        from dataclasses import replace

        found = first_stop(res.text, self.stop)
        return replace(res, text=res.text[:found[0]] if found else res.text,
                       stats={**res.stats, "stop_sequence": self.hit})


class TextStream:
    """Incremental text of a token stream whose concatenated deltas equal the engine's final text
    (``decode(tokens minus EOS, skip_special_tokens=True).strip()``): leading whitespace is dropped,
    trailing whitespace and incomplete UTF-8 are held back until more text follows. With ``stop``
    strings, nothing from the first stop string on is sent, and a tail that may start one is held back."""

    def __init__(self, tokenizer, eos_ids, stop: list[str] | None = None):
        self.tok, self.eos = tokenizer, set(eos_ids)
        self.stop = list(stop or [])
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if token in self.eos or self.stopped:
            return ""
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True).lstrip()
        safe = text.rstrip("\ufffd").rstrip()
        if self.stop:
            found = first_stop(text, self.stop)
            if found is not None:
                self.stopped = True
                safe = text[:found[0]]
            else:
                visible = text.rstrip("\ufffd")
                safe = safe[:len(visible) - partial_stop(visible, self.stop)]
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final: str) -> str:
        if final.startswith(self.sent):
            delta, self.sent = final[len(self.sent):], final
            return delta
        return ""  # cannot happen for prefix-stable tokenizers; never resend text

