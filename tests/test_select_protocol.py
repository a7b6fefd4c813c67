"""The selector seam: selectors work through `SelectionContext` (no engine import, no engine calls),
selection is prepare -> score -> pick, and wrappers pass every capability on."""

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import kvstitch
from kvstitch.core.errors import InputError
from kvstitch.select import SELECTORS, SelectionContext, Selector, make_selector, register

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

SELECT_DIR = Path(kvstitch.__file__).parent / "select"


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Modules imported outside `if TYPE_CHECKING:` blocks (relative imports as written, e.g. '..engine')."""
    out = []

    def visit(node, guarded=False):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded = True
        if not guarded and isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
        if not guarded and isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree)
    return out


def test_select_never_imports_the_engine_nor_private_attention():
    for path in SELECT_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports = _runtime_imports(tree)
        assert not [m for m in imports if m.endswith("engine")], f"{path.name} imports the engine: {imports}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private names {private} from {node.module}"


def test_selectors_use_the_context_not_engine_internals():
    """Outside context.py (the seam) no selector touches the engine's model adapter, its forward pass, its
    store or an underscore member of anything."""
    for path in SELECT_DIR.glob("*.py"):
        if path.name == "context.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                    node.value.attr == "engine":
                raise AssertionError(f"{path.name}:{node.lineno}: reaches through ctx.engine.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr in ("forward", "store", "inv_freq"):
                raise AssertionError(f"{path.name}:{node.lineno}: uses engine internals (.{node.attr})")


def test_select_is_final_steps_are_overridden():
    for name, cls in SELECTORS.items():
        assert cls.select is Selector.select, f"{name} overrides select: override prepare / score / pick"


def test_grouped_passes_every_capability_on(smollm_tokenizer):
    with pytest.raises(InputError, match="full"):
        make_selector("grouped", base="full")  # it used to silently pick "the first k tokens"
    assert make_selector("grouped", base="oracle").needs_full_prefill
    assert make_selector("grouped", base="ape").zero_budget and make_selector("grouped", base="ape").adjusts_decode()
    assert make_selector("grouped", base="naive").zero_budget
    # the base's prompt change (InfoFlow's reorder) runs, only the picking is grouped
    eng = make_tiny_engine("llama", smollm_tokenizer)
    chunks = SAMPLE_CHUNKS + ["The river flooded twice in spring; the old mill lost its wheel."]

    def ctx():
        lay = eng.layout(SAMPLE_QUESTION, chunks)
        return SelectionContext(eng, eng.stitch(lay, eng.chunk_kvs(lay)), lay, round(0.3 * lay.n_context))

    a, b = ctx(), ctx()
    idx, scores = make_selector("grouped", base="infoflow_reorder", refill=True).select(a)
    ref_idx, ref_scores = make_selector("infoflow_reorder").select(b)
    assert a.stats["order"] == b.stats["order"] and torch.equal(scores, ref_scores)
    from kvstitch.select.grouping import grouped_top_k

    assert torch.equal(idx, grouped_top_k(ref_scores, a.budget, refill=True))


def test_a_new_method_is_one_class_through_the_context(smollm_tokenizer):
    """A toy method written against the context only (shapes, query attention, fresh pass, reorder) runs
    through the engine with no other edit."""

    @register
    @dataclass
    class Toy(Selector):
        name: ClassVar[str] = "toy_protocol"

        def prepare(self, ctx):
            ctx.reorder(list(reversed(range(len(ctx.layout.chunk_ids)))))

        def score(self, ctx):
            att = ctx.query_attention([ctx.num_layers - 1])[ctx.num_layers - 1]  # [Hq, n]
            fp = ctx.fresh_pass(1)
            assert att.shape == (ctx.num_q_heads, ctx.n_context) and fp.delta_v.shape[1] == ctx.n_context
            return att.mean(0) + fp.delta_v.norm(dim=(0, 2)).to(att.device)

    try:
        eng = make_tiny_engine("llama", smollm_tokenizer)
        res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="toy_protocol", recompute_ratio=0.2, max_new_tokens=2)
        assert res.stats["order"] == [3, 2, 1, 0] and len(res.recomputed) == round(0.2 * res.stats["context_tokens"])
    finally:
        del SELECTORS["toy_protocol"]
