"""scripts/deltaprop_diagnose.py tries two fixes of deltaprop's digit corruption outside the library: a guarded
span left uncorrected ("guard") or recomputed first ("span"). Its figures are cited, so its mechanisms are tested."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "deltaprop_diagnose.py"


@pytest.fixture(scope="module")
def diag():
    spec = importlib.util.spec_from_file_location("deltaprop_diagnose", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through it
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_guard_mask_is_the_window_around_the_top_scores(diag):
    scores = torch.zeros(50)
    scores[[10, 40]] = torch.tensor([3.0, 2.0])
    scores[45] = 1.0  # third: outside the top 2 (= ceil(0.04 * 50))
    assert diag.guard_mask(scores, 0.04, 2).nonzero().flatten().tolist() == [8, 9, 10, 11, 12, 38, 39, 40, 41, 42]
    assert diag.guard_mask(scores, 0.02, 0).nonzero().flatten().tolist() == [10]
    assert diag.guard_mask(torch.ones(3), 1.0, 8).all()  # a window wider than the context


def test_guard_leaves_the_span_as_prophet_does_and_span_recomputes_it(diag, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    c0 = layout.context_start
    pre_p = eng.prefill(layout, "prophet", 0.3)
    pre_d = eng.prefill(layout, "deltaprop", 0.3, selector=diag.Guarded(top=0.0, probe_stride=0))  # no anchor
    pre_g = eng.prefill(layout, "deltaprop", 0.3, selector=diag.Guarded(top=0.05, window=2, probe_stride=0))
    assert torch.equal(pre_g.indices, pre_p.indices)
    guarded = pre_g.cache.fresh.clone()
    guarded[pre_g.indices] = False  # guarded and stale
    assert 0 < int(guarded.sum()) < guarded.numel() // 2
    idx = guarded.nonzero().flatten() + c0
    li = eng.adapter.num_layers - 1
    assert torch.equal(pre_g.cache.layers[li].values[0, :, idx], pre_p.cache.layers[li].values[0, :, idx])
    assert not torch.equal(pre_d.cache.layers[li].values[0, :, idx], pre_p.cache.layers[li].values[0, :, idx])
    sel = diag.Guarded(top=0.05, window=2, mode="span", probe_stride=0)
    pre_s = eng.prefill(layout, "deltaprop", 0.3, selector=sel)
    span = set((guarded.nonzero().flatten()).tolist())
    assert span <= set(pre_s.indices.tolist()) and pre_s.indices.numel() == pre_p.indices.numel()
