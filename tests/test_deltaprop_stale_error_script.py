"""scripts/deltaprop_stale_error.py measures how far the stale K/V a method leaves are from full prefill's (its
figures are cited in docs/results/own-method): the measure itself is checked here."""

import importlib.util
import sys
from pathlib import Path

import pytest

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "deltaprop_stale_error.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("deltaprop_stale_error", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_stale_error_is_the_stitched_error_at_zero_and_nothing_at_full_budget(script, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    full_cache, _ = eng.full_prefill(layout)
    c0, c1 = layout.context_start, layout.context_end
    stitched = eng.stitch(layout, eng.chunk_kvs(layout))
    got = script.stale_errors(eng, layout, full_cache, "prophet", {}, 0.0)  # nothing recomputed: all stale
    n_layers = len(full_cache.layers)
    for kind in ("values", "keys"):
        want = sum(float(((getattr(s, kind)[0, :, c0:c1] - getattr(f, kind)[0, :, c0:c1]) ** 2).sum())
                   for li, (s, f) in enumerate(zip(stitched.layers, full_cache.layers)) if 3 * li // n_layers == 0)
        assert got[(kind, "lower")] == pytest.approx(want, rel=1e-5)
        assert want > 0
    assert all(v == 0.0 for v in script.stale_errors(eng, layout, full_cache, "deltaprop", {}, 1.0).values())


def test_shift_energy_estimates_leave_less_than_the_shift(script, smollm_tokenizer):
    """The oracle (the held-out tokens' own chunk mean) is the best constant per chunk: never worse than none."""
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    full_cache, _ = eng.full_prefill(layout)
    got = script.shift_energy(eng, layout, full_cache)
    for kind in ("values", "keys"):
        none = got[(kind, "lower", "none")]
        assert none > 0
        assert got[(kind, "lower", "best constant per chunk (oracle)")] <= none * (1 + 1e-6)
        assert all(got[(kind, "lower", e)] >= 0 for e in script.ESTIMATES)
