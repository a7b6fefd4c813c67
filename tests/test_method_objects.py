"""Methods as typed objects: one spec grammar, every option of every method reachable from each surface, aliases
for the variant names, and wrappers that forward every hook. Parametrised over the whole registry: a method
added to it is covered without an edit here."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest
import torch
from typer.testing import CliRunner

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.errors import BadMethodOption, InputError, UnknownMethod
from kvstitch.select import (A3, ALIASES, SELECTORS, CacheClip, DeltaProp, Grouped, InfoFlow, Oracle, Prophet, QCFuse,
                             Random, SelectionContext, Selector, check_method, format_spec, from_mapping, make_selector,
                             methods, resolve_methods, split_specs)
from kvstitch.core.options import field_default
from kvstitch.select.method import WRAPPED_FLAGS, WRAPPED_HOOKS, spec_fields, type_hints
from kvstitch.core.spec import format_value

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

runner = CliRunner()
# the registry's names before variants became options: `--methods all` still runs exactly these
PUBLISHED = ["a3", "a3_stitched", "ape", "cacheblend", "cacheclip", "cacheclip_refill", "deltaprop", "epic", "full",
             "grouped", "infoflow", "infoflow_reorder", "infoflow_reorder_max", "kvshare", "naive", "oracle",
             "oracle_ideal", "prophet", "qcfuse", "random"]
# what each alias stood for, written as Python (the objects the old registry classes were)
ALIAS_OBJECTS = {"a3_stitched": lambda: A3(stitched=True), "cacheclip_refill": lambda: CacheClip(refill=True),
                 "infoflow_reorder": lambda: InfoFlow(reorder="topk_mass"),
                 "infoflow_reorder_max": lambda: InfoFlow(reorder="max"), "oracle_ideal": lambda: Oracle(mode="ideal")}
# composite specs and the objects they stand for
COMPOSITES = {
    "deltaprop(base=infoflow(reorder=max), alpha_k=0.5)": lambda: DeltaProp(base=InfoFlow(reorder="max"), alpha_k=0.5),
    "deltaprop:base=infoflow,probe_stride=0": lambda: DeltaProp(base=InfoFlow(), probe_stride=0),
    "deltaprop:base=a3_stitched": lambda: DeltaProp(base=A3(stitched=True)),
    "deltaprop(base=qcfuse, fusion=union, attend_top=1)": lambda: DeltaProp(base=QCFuse(), fusion="union", attend_top=1),
    "grouped(base=random(seed=3), group_size=4, group_min=3, refill=true)":
        lambda: Grouped(base=Random(seed=3), group_size=4, group_min=3, refill=True),
    "infoflow(layers=[0, 2], weight=value)": lambda: InfoFlow(layers=(0, 2), weight="value"),
    "a3(layer=2, evict_capacity=8)": lambda: A3(layer=2, evict_capacity=8),
}


def _candidates(hint, default) -> list:
    """Values of an option's type that differ from its default (the first one the method accepts is used)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return [a for a in args if a != default]
    if args and type(None) in args:  # optional: a value of its type, or none
        inner = [a for a in args if a is not type(None)]
        return ([None] if default is not None else []) + [v for a in inner for v in _candidates(a, None)]
    if hint is bool:
        return [not default]
    if hint is int:
        return [v for v in ((default or 0) + 2, (default or 0) + 1, 3) if v != default]
    if hint is float:
        return [v for v in ((default or 0.0) + 0.5, (default or 1.0) * 0.5) if v != default]
    if origin is tuple:
        return [(0.25, 0.5), (1, 2), (0, 1)]
    if hint is str:
        return ["self", "cpu"]
    if isinstance(hint, type) and issubclass(hint, Selector):
        return [Random(seed=1), InfoFlow(reorder="max")]
    return []


def _non_default(cls, f):
    hint = type_hints(cls)[f.name]
    for v in _candidates(hint, field_default(f)):
        try:
            return v, cls(**{f.name: v})
        except InputError:
            continue
    raise AssertionError(f"no non-default value found for {cls.name}.{f.name}")


OPTIONS = [(name, f.name) for name in methods() for f in spec_fields(SELECTORS[name])]


# ---- the grammar and the registry ----------------------------------------------------------------------
def test_methods_lists_methods_and_all_keeps_the_published_names():
    assert not set(ALIASES) & set(methods())  # variants are options, not methods
    assert resolve_methods("all") == PUBLISHED
    assert resolve_methods("all", exclude="cacheclip,cacheclip_refill") == [m for m in PUBLISHED if "cacheclip" not in m]


@pytest.mark.parametrize("name,option", OPTIONS)
def test_every_option_from_a_spec_equals_the_object_and_round_trips(name, option):
    cls = SELECTORS[name]
    f = next(f for f in spec_fields(cls) if f.name == option)
    value, direct = _non_default(cls, f)
    parsed = make_selector(direct.spec)
    assert parsed == direct and type(parsed) is cls
    assert f"{option}=" in direct.spec and str(direct) == direct.spec  # non-default options are spelled out
    assert make_selector(f"{name}:{option}={format_value(value)}") == direct  # the short form
    assert make_selector(direct.label) == direct


@pytest.mark.parametrize("name", methods())
def test_defaults_are_the_bare_name_and_unknown_options_name_the_valid_ones(name):
    obj = make_selector(name)
    assert obj == SELECTORS[name]() and obj.spec == name and obj.label == name
    assert make_selector(f"{name}()") == obj
    with pytest.raises(BadMethodOption) as e:
        make_selector(f"{name}(no_such_option=1)")
    msg = str(e.value)
    assert "unknown option 'no_such_option'" in msg
    assert all(f.name in msg for f in spec_fields(SELECTORS[name])) or "no options" in msg


@pytest.mark.parametrize("name,option", [(n, o) for n, o in OPTIONS
                                         if typing.get_origin(type_hints(SELECTORS[n])[o]) is Literal])
def test_a_value_outside_the_choices_names_them(name, option):
    choices = typing.get_args(type_hints(SELECTORS[name])[option])
    with pytest.raises(BadMethodOption) as e:
        make_selector(f"{name}({option}=not_a_choice)")
    assert all(c in str(e.value) for c in choices)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_alias_parses_to_its_object_and_keeps_its_label(alias):
    obj = make_selector(alias)
    assert obj == ALIAS_OBJECTS[alias]() == make_selector(ALIASES[alias])
    assert obj.label == alias and check_method(obj.spec) == alias  # rows written under the alias stay its
    assert make_selector(obj.spec) == obj


@pytest.mark.parametrize("spec", sorted(COMPOSITES))
def test_composite_specs(spec):
    obj = make_selector(spec)
    assert obj == COMPOSITES[spec]()
    assert make_selector(obj.spec) == obj and make_selector(obj.label) == obj
    assert " " not in obj.spec


@pytest.mark.parametrize("spec,error,says", [
    ("nope", UnknownMethod, "known methods: a3, ape"),
    ("nope", UnknownMethod, "aliases: a3_stitched"),
    ("deltaprop(base=nope)", BadMethodOption, "deltaprop: base: unknown method 'nope'"),
    ("deltaprop(alpha_k=x)", BadMethodOption, "alpha_k must be a number"),
    ("random(seed=1.5)", BadMethodOption, "seed must be an integer"),
    ("deltaprop(base=naive)", BadMethodOption, "recomputes a budget"),
    ("grouped(base=full)", BadMethodOption, "prefills from scratch"),
    ("deltaprop(base=deltaprop)", BadMethodOption, "cannot wrap itself"),
    ("random(seed=1", BadMethodOption, "expected ')'"),
    ("random(seed=1, seed=2)", BadMethodOption, "given twice"),
    ("infoflow_reorder_max(nope=1)", BadMethodOption, "infoflow takes: band, layers"),
])
def test_bad_specs_are_typed_errors(spec, error, says):
    with pytest.raises(error) as e:
        make_selector(spec)
    assert says in str(e.value)


def test_split_specs_keeps_commas_inside_a_spec():
    text = "prophet, deltaprop(base=infoflow(reorder=max),alpha_k=0.5),grouped:base=random,refill=true, a3"
    assert split_specs(text) == ["prophet", "deltaprop(base=infoflow(reorder=max),alpha_k=0.5)",
                                 "grouped:base=random,refill=true", "a3"]
    assert resolve_methods(text) == ["prophet", "deltaprop(base=infoflow(reorder=max),alpha_k=0.5)",
                                     "grouped(base=random,refill=true)", "a3"]


def test_python_options_and_method_options_merge_into_the_object():
    assert make_selector("deltaprop", base="infoflow", alpha_k=0.5) == DeltaProp(base=InfoFlow(), alpha_k=0.5)
    assert make_selector("grouped", base="random", base_options={"seed": 3}) == Grouped(base=Random(seed=3))
    assert make_selector(DeltaProp(), tau=2) == DeltaProp(tau=2.0)
    assert from_mapping({"name": "deltaprop", "alpha_k": 0.5, "base": {"name": "infoflow", "reorder": "max"}}) == \
        DeltaProp(base=InfoFlow(reorder="max"), alpha_k=0.5)
    assert format_spec(Prophet()) == "prophet"
    with pytest.raises(BadMethodOption, match="a3: layer must be an integer"):
        A3(layer="x")  # the object checks itself, whichever way it is built


# ---- same selection: spec string -> object vs the object built directly ----------------------------------
def _selection(eng, sel, ratio=0.3):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    ctx = SelectionContext(eng, eng.stitch(layout, eng.chunk_kvs(layout)), layout, round(ratio * layout.n_context))
    idx, _ = sel.select(ctx)
    return idx, ctx.stats.get("order")


SELECTING = {**{n: SELECTORS[n] for n in methods() if not SELECTORS[n].full_prefill and n != "cacheclip"},
             "cacheclip(aux_model=self)": lambda: CacheClip(aux_model="self"), **ALIAS_OBJECTS, **COMPOSITES}
SELECTING["cacheclip_refill(aux_model=self)"] = lambda: CacheClip(refill=True, aux_model="self")
del SELECTING["cacheclip_refill"]


@pytest.mark.parametrize("spec", sorted(SELECTING))
def test_spec_selects_what_the_object_selects(spec, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    direct, parsed = SELECTING[spec](), make_selector(spec)
    assert parsed == direct
    a, order_a = _selection(eng, parsed)
    b, order_b = _selection(eng, direct)
    assert torch.equal(a, b) and order_a == order_b


# ---- wrappers forward every hook ------------------------------------------------------------------------
CALLS: list[str] = []


@dataclass
class Spy(Selector):
    """Records every hook the engine reaches (not registered: a wrapper takes the object itself)."""

    name: ClassVar[str] = "spy_hooks"

    def prepare(self, ctx):
        CALLS.append("prepare")

    def score(self, ctx):
        CALLS.append("score")
        return torch.arange(ctx.n_context, dtype=torch.float32)

    def pick(self, scores, ctx):
        CALLS.append("pick")
        return scores.topk(ctx.budget).indices.sort().values

    def chunk_anchors(self):
        CALLS.append("chunk_anchors")
        return None

    def recompute_plan(self, ctx):
        CALLS.append("recompute_plan")
        return ForwardPlan()

    def adjusts_decode(self):
        CALLS.append("adjusts_decode")
        return True

    def decode_plan(self, engine, cache, layout, stats):
        CALLS.append("decode_plan")
        return ForwardPlan()


@pytest.mark.parametrize("wrap", [lambda b: DeltaProp(base=b, probe_stride=0), lambda b: Grouped(base=b, group_min=1),
                                  lambda b: DeltaProp(base=Grouped(base=b, group_min=1), probe_stride=0)],
                         ids=["deltaprop", "grouped", "deltaprop-over-grouped"])
def test_every_hook_of_the_base_reaches_the_engine_through_a_wrapper(wrap, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    sel = wrap(Spy())
    CALLS.clear()
    with pytest.raises(InputError, match="changes decode attention"):  # the engine's guard sees the base's hook
        eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=sel, recompute_ratio=0.3, decode="prkv", kv_budget=64)
    assert CALLS == ["adjusts_decode"]
    CALLS.clear()
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=sel, recompute_ratio=0.3, max_new_tokens=3)
    own_pick = isinstance(sel, Grouped) or isinstance(getattr(sel, "base", None), Grouped)
    want = set(WRAPPED_HOOKS) - {"adjusts_decode"} - ({"pick"} if own_pick else set())
    assert want <= set(CALLS), f"hooks that never reached the engine: {want - set(CALLS)}"
    assert ("pick" in CALLS) != own_pick  # grouping is the one hook a grouped wrapper redefines
    n = res.stats["context_tokens"]
    assert res.recomputed == list(range(n - round(0.3 * n), n))  # the base's scores chose (its top tokens)
    assert res.method == sel.label


@dataclass
class ZeroSpy(Spy):
    name: ClassVar[str] = "zero_spy"
    zero_budget: ClassVar[bool] = True
    needs_full_prefill: ClassVar[bool] = True
    exact_budget: ClassVar[bool] = False


def test_wrappers_forward_the_flags():
    for flag in WRAPPED_FLAGS:
        for base in (Spy(), ZeroSpy()):
            wrapped = Grouped(base=base)
            want = wrapped.refill if flag == "exact_budget" else getattr(base, flag)  # grouping's own budget rule
            assert getattr(wrapped, flag) == want, flag
    assert not DeltaProp(base=Spy()).zero_budget and DeltaProp(base=Spy()).exact_budget
    assert not DeltaProp(base=CacheClip()).exact_budget  # the base's grouping may drop windows
    with pytest.raises(BadMethodOption, match="recomputes a budget"):
        DeltaProp(base=ZeroSpy())


@pytest.mark.parametrize("spec", ["deltaprop(base=a3(evict_capacity=8))", "grouped(base=a3(evict_capacity=8))"])
def test_a_wrapper_over_a3_keeps_its_eviction_and_the_decode_guard(spec, smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=spec, recompute_ratio=0.3, max_new_tokens=3)
    alone = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="a3(evict_capacity=8)", recompute_ratio=0.3,
                         max_new_tokens=3)
    assert res.stats["evict_capacity"] == 8  # A3's decode plan ran through the wrapper
    assert res.stats["kv_kept_per_head"] == alone.stats["kv_kept_per_head"]
    assert res.stats["evicted_per_head"] == alone.stats["evicted_per_head"] > 0
    with pytest.raises(InputError, match="changes decode attention"):
        eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=spec, recompute_ratio=0.3, decode="prkv", kv_budget=64)


# ---- every surface takes a spec with options -----------------------------------------------------------
SPEC = "deltaprop(base=infoflow(reorder=max),alpha_k=0.5)"


def test_generate_takes_an_object_a_spec_or_make_selector_options(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    kw = dict(recompute_ratio=0.3, max_new_tokens=3)
    a = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=DeltaProp(base=InfoFlow(reorder="max"), alpha_k=0.5), **kw)
    b = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=SPEC, **kw)
    c = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=make_selector("deltaprop:base=infoflow_reorder_max",
                                                                          alpha_k=0.5), **kw)
    d = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method="deltaprop", **kw)
    for r in (b, c):
        assert r.recomputed == a.recomputed and r.token_ids == a.token_ids and r.stats["order"] == a.stats["order"]
        assert torch.equal(r.first_logits, a.first_logits)
        assert r.method == r.stats["method"] == SPEC
    assert d.method == "deltaprop" and not torch.equal(d.first_logits, a.first_logits)  # the options took effect


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smollm_tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama-methods")
    make_tiny_engine("llama", smollm_tokenizer).model.save_pretrained(str(d))
    smollm_tokenizer.save_pretrained(str(d))
    return d


def test_cli_ask_takes_a_spec(tiny_model_dir, tmp_path):
    from kvstitch.cli.main import app

    files = []
    for i, text in enumerate(SAMPLE_CHUNKS):
        (tmp_path / f"{i}.txt").write_text(text)
        files += ["--chunk", str(tmp_path / f"{i}.txt")]
    args = ["ask", SAMPLE_QUESTION, *files, "--ratio", "0.3", "--max-new-tokens", "2", "--model", str(tiny_model_dir)]
    r = runner.invoke(app, [*args, "--method", "deltaprop:base=infoflow_reorder_max,alpha_k=0.5"])
    assert r.exit_code == 0, r.output
    assert SPEC in r.output  # printed under its label
    r = runner.invoke(app, [*args, "--method", "prophet(window=3)"])
    assert r.exit_code == 2 and "unknown option 'window'" in r.output


def test_cli_eval_records_the_spec_and_resumes_under_an_alias(tiny_model_dir, tmp_path):
    from kvstitch.cli.main import app
    from kvstitch.eval.rows import read_jsonl

    common = ["eval", "--tasks", "niah_single_essay", "--length", "160", "--chunk-tokens", "64", "--n", "1",
              "--ratios", "0.3", "--max-new-tokens", "3", "--haystack", "synthetic", "--no-overlap", "--threads", "1",
              "--model", str(tiny_model_dir), "--out", str(tmp_path)]
    r = runner.invoke(app, [*common, "--methods", f"{SPEC},infoflow(reorder=max),random(seed=2)"])
    assert r.exit_code == 0, r.output
    rows = read_jsonl(tmp_path / "results.jsonl")
    by = {row["method"]: row for row in rows}
    assert set(by) == {"full", "naive", SPEC, "infoflow_reorder_max", "random(seed=2)"}
    assert by["infoflow_reorder_max"]["method_spec"] == "infoflow(reorder=max)"
    assert all(make_selector(row["method_spec"]) == make_selector(row["method"]) for row in rows)
    # the same methods spelled otherwise: nothing is run again
    r = runner.invoke(app, [*common, "--methods", "deltaprop:base=infoflow(reorder=max),alpha_k=0.5,"
                                                 "infoflow_reorder_max,random:seed=2"])
    assert r.exit_code == 0, r.output
    assert len(read_jsonl(tmp_path / "results.jsonl")) == len(rows)


def test_cli_methods_lists_each_method_with_its_options_and_the_aliases():
    from kvstitch.cli.main import app

    r = runner.invoke(app, ["methods"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for name in methods():
        assert f"\n{name} " in "\n" + r.output
        for f in spec_fields(SELECTORS[name]):
            assert f"  {f.name}={format_value(field_default(f))} " in r.output
    for alias, spec in ALIASES.items():
        assert alias in r.output and spec in r.output


def test_calibrate_takes_specs():
    from kvstitch.eval.calibrate import configs

    cfgs = configs(split_specs(f"prophet,{SPEC}"), [0.2], [])
    assert [c.method for c in cfgs] == ["prophet", SPEC]
    with pytest.raises(BadMethodOption, match="unknown option"):
        configs(["prophet(x=1)"], [0.2], [])


def test_config_file_takes_a_spec_or_a_table(tmp_path):
    import typer

    from kvstitch.cli.main import app
    from kvstitch.serve.config import read_answer_settings

    table = tmp_path / "table.toml"
    table.write_text('[method]\nname = "deltaprop"\nalpha_k = 0.5\nbase = { name = "infoflow", reorder = "max" }\n')
    text = tmp_path / "text.toml"
    text.write_text('method = "deltaprop(base=infoflow_reorder_max, alpha_k=0.5)"\n')
    cmd = typer.main.get_command(app).commands["serve"]
    for conf in (table, text):
        assert read_answer_settings(conf)["method"] == SPEC  # ask --config
        assert cmd.make_context("serve", ["--config", str(conf)]).params["method"] == SPEC  # serve --config
    bad = tmp_path / "bad.toml"
    bad.write_text('[method]\nname = "deltaprop"\nalpha = 0.5\n')
    with pytest.raises(BadMethodOption, match="unknown option 'alpha'; deltaprop takes: base, alpha_v, alpha_k"):
        read_answer_settings(bad)
    r = runner.invoke(app, ["serve", "--method", "deltaprop(alpha=1)", "--model", "/nowhere/model.gguf"])
    assert r.exit_code != 0 and "unknown option 'alpha'" in str(r.exception) + r.output  # before the model loads


def test_server_takes_a_spec_per_request_and_as_its_default(smollm_tokenizer):
    import httpx

    from kvstitch.serve.server import create_app
    from kvstitch.serve.testing import ServerThread

    eng = make_tiny_engine("llama", smollm_tokenizer)
    app = create_app(eng, default_method="deltaprop:base=infoflow_reorder_max,alpha_k=0.5", default_ratio=0.3,
                     model_name="tiny-llama")
    messages = [{"role": "user", "content": SAMPLE_QUESTION}]
    body = {"model": "tiny-llama", "messages": messages, "documents": SAMPLE_CHUNKS, "max_tokens": 3}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        outs = [client.post("/v1/chat/completions", json={**body, **extra}).json() for extra in
                ({}, {"method": "a3(evict_capacity=8)"}, {"method": "random", "method_options": {"seed": 3}})]
        bad = client.post("/v1/chat/completions", json={**body, "method": "random(sed=3)"})
    assert [o["kvstitch"]["method"] for o in outs] == [SPEC, "a3(evict_capacity=8)", "random(seed=3)"]
    ref = eng.generate(messages=messages, chunks=SAMPLE_CHUNKS, method=SPEC, recompute_ratio=0.3, max_new_tokens=3)
    assert outs[0]["choices"][0]["message"]["content"] == ref.text
    assert outs[0]["kvstitch"]["recomputed_tokens"] == ref.stats["recomputed_tokens"]
    err = bad.json()["error"]
    assert bad.status_code == 400 and err["param"] == "method" and "random takes: seed" in err["message"]
