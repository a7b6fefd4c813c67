"""`StitchCache.mode`: cache modes (slots / write / capture / decoder) are scoped, nest, and come back
after an error; `Engine.forward` leaves a cache in the modes it found it in."""

from __future__ import annotations

import pytest
import torch

from kvstitch.core.cache import StitchCache

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION


def _modes(cache):
    return (None if cache.slots is None else cache.slots.tolist(), cache.write, set(cache.capture),
            dict(cache.captured), cache.decoder)


class _Adapter:
    num_kv_heads, head_dim, num_layers = 2, 4, 3


def _cache():
    return StitchCache.empty(_Adapter(), 8, "cpu", torch.float32)


def test_mode_scopes_nests_and_restores():
    cache = _cache()
    default = _modes(cache)
    assert default == (None, True, set(), {}, None)
    with cache.mode(slots=torch.tensor([2, 3]), write=False) as rec:
        assert cache.slots.tolist() == [2, 3] and cache.write is False and rec is cache.captured
        with cache.mode(capture={1}) as captured:
            assert cache.slots.tolist() == [2, 3] and cache.write is False  # untouched by the inner scope
            k = torch.randn(1, 2, 2, 4)
            cache.update(k, k + 1, 1)
            cache.update(k, k, 0)
        assert set(captured) == {1} and torch.equal(captured[1][0], k)  # readable after the scope
        assert cache.capture == set() and cache.captured == {}  # the outer record is back
        assert cache.slots.tolist() == [2, 3] and cache.write is False
    assert _modes(cache) == default
    assert cache.length == 0  # write=False: the scoped updates were out of place


def test_mode_restores_after_an_error():
    cache = _cache()
    marker = object()
    with pytest.raises(RuntimeError, match="boom"):
        with cache.mode(slots=torch.tensor([0]), write=False, capture={0, 2}, decoder=marker):
            assert cache.decoder is marker and cache.capture == {0, 2}
            raise RuntimeError("boom")
    assert _modes(cache) == (None, True, set(), {}, None)


def test_mode_rejects_unknown_modes():
    with pytest.raises(TypeError):
        with _cache().mode(slot=[1]):  # a typo must not pass silently
            pass


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_engine_forward_keeps_callers_modes(tiny_engine):
    eng = tiny_engine
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    cache = StitchCache.empty(eng.adapter, layout.n_total, eng.device, eng.dtype)
    n = layout.context_end
    with cache.mode(capture={1}) as captured:
        eng.forward(cache, layout.ids[:n], torch.arange(n), write=False)
        assert cache.capture == {1} and cache.slots is None and cache.write is True
    assert captured[1][0].shape[-2] == n and cache.length == 0  # out of place, layer 1 captured
    eng.forward(cache, layout.ids[:n], torch.arange(n))
    assert cache.length == n and _modes(cache) == (None, True, set(), {}, None)
