"""Sampling the next token, the stop rules (when an answer is finished) and an answer's text: what decoding, the
teacher-forcing helper and the adaptive budget share."""

from __future__ import annotations

import torch


def sample(engine, logits: torch.Tensor, temperature: float, top_p: float, seed: int, step: int = 0,
           no_eos: bool = False) -> int:
    """The next token: argmax at temperature 0, else nucleus sampling seeded by (seed, step)."""
    if no_eos:  # the answer is shorter than its min_new_tokens: EOS cannot be chosen
        logits = logits.clone()
        logits[..., sorted(engine.eos_ids)] = float("-inf")
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
    g = torch.Generator(device="cpu").manual_seed(seed * 100003 + step)
    return int(torch.multinomial(probs.cpu(), 1, generator=g))


def stop_text(engine, tokens: list[int]) -> bool:
    """Base models (no chat template) keep writing after the answer: stop at the first line break."""
    if getattr(engine.tokenizer, "chat_template", None):
        return False
    return "\n" in engine.tokenizer.decode(tokens, skip_special_tokens=True).lstrip()


def finished(engine, tokens: list[int]) -> bool:
    """True when an answer is complete: it ends with EOS, or a base model wrote its line (`stop_text`)."""
    return bool(tokens) and (tokens[-1] in engine.eos_ids or stop_text(engine, tokens))


def answer_text(engine, tokens: list[int], strip: bool = True) -> str:
    """The answer's text: its tokens without EOS, special tokens skipped; stripped unless ``strip`` is False."""
    text = engine.tokenizer.decode([t for t in tokens if t not in engine.eos_ids], skip_special_tokens=True)
    return text.strip() if strip else text
