"""Decode policies and the adaptive budget as typed objects, with the spec grammar of methods: every option of
every registered policy (and of `AutoBudget`) reachable as a spec string that builds the object built directly,
canonical specs that round-trip, typed errors naming the valid choices, ``full`` as the alias of ``dense``, and
the same answer and stats from a spec string and from its object on a tiny model, on every surface. Parametrised
over the registries: a policy added to `DECODE_POLICIES` is covered without an edit here."""

from __future__ import annotations

import dataclasses
import typing

import httpx
import pytest
from typer.testing import CliRunner

import kvstitch
from kvstitch.cli.main import app
from kvstitch.core.errors import BadAutoOption, BadDecodeOption, BadRatio, InputError, UnknownDecodePolicy
from kvstitch.core.spec import format_value
from kvstitch.decode import (DECODE_POLICIES, PRKV, ArkVale, Dense, Quest, ShadowKV, SnapKV, is_dense, make_decoder,
                             make_policy, policy_budget)
from kvstitch.decode.policies import DIGESTS, GROUP_REDUCES
from kvstitch.engine.budget import AUTO, AutoBudget, parse_ratio, ratio_value, split_ratio
from kvstitch.eval.calibrate import parse_auto
from kvstitch.eval.config import parse_ratios
from kvstitch.serve.config import read_answer_settings, read_config
from kvstitch.serve.defaults import ChatDefaults
from kvstitch.serve.schema import parse_chat_body
from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tiny_engine

SHORT_NAMES = {"dense": Dense, "prkv": PRKV, "quest": Quest, "arkvale": ArkVale, "snapkv": SnapKV,
               "shadowkv": ShadowKV}
POLICIES = sorted(DECODE_POLICIES)
SPARSE = [p for p in POLICIES if not DECODE_POLICIES[p]().select_all()]
CHUNKS = SAMPLE_CHUNKS * 3
AUTO_CHUNKS = SAMPLE_CHUNKS * 2


def _options(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _candidates(hint, default) -> list:
    """Values of an option's type that differ from its default (the first one the class accepts is used)."""
    if typing.get_origin(hint) is tuple:
        return [(0.1,), (0.1, 0.2)]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return [a for a in args if a != default]
    if args:  # a union: each arm's values, none first when it is not the default
        return ([None] if type(None) in args and default is not None else []) + \
            [v for a in args if a is not type(None) for v in _candidates(a, default)]
    if hint is bool:
        return [not default]
    if hint is int:
        return [v for v in ((default or 0) + 2, (default or 0) + 1, 3, 32) if v != default]
    if hint is float:
        return [v for v in ((default or 0.0) + 0.5, (default or 1.0) * 0.5, 0.05) if v != default]
    if hint is str:
        return [v for v in (*GROUP_REDUCES, *DIGESTS, "auto", "incremental", "attention", "answer") if v != default]
    return []


def _set_one(cls, f: dataclasses.Field):
    """(value, object) for the first candidate of option ``f`` that ``cls`` accepts."""
    hint = typing.get_type_hints(cls)[f.name]
    for v in _candidates(hint, f.default):
        try:
            return v, cls(**{f.name: v})
        except InputError:
            continue
    raise AssertionError(f"no accepted value for {cls.__name__}.{f.name}")


def _stable(stats) -> dict:
    """The stats that do not depend on the clock."""
    return {k: v for k, v in stats.to_dict().items() if not k.endswith("_s")}


# ---- the registry and the grammar, every policy and option --------------------------------------------------
def test_every_policy_has_a_short_class_exported_and_its_old_name_kept():
    assert {n: DECODE_POLICIES[n] for n in POLICIES} == {n: SHORT_NAMES[n] for n in POLICIES}
    for cls in SHORT_NAMES.values():
        assert getattr(kvstitch, cls.__name__) is cls  # top level
    assert kvstitch.AutoBudget is AutoBudget


@pytest.mark.parametrize("name", POLICIES)
def test_every_option_as_a_spec_builds_the_object_built_directly(name):
    cls = DECODE_POLICIES[name]
    assert make_policy(name) == cls() and cls().spec == name and str(cls()) == name  # defaults: the bare name
    for f in _options(cls):
        value, direct = _set_one(cls, f)
        text = format_value(value)
        assert make_policy(f"{name}({f.name}={text})") == direct
        assert make_policy(f"{name}:{f.name}={text}") == direct  # the short form
        assert make_policy(name, **{f.name: value}) == direct  # Python keywords (decode_options)
        assert direct.spec == f"{name}({f.name}={text})"  # canonical: only what differs from the default
        assert make_policy(direct.spec) == direct and make_policy(direct) is direct


@pytest.mark.parametrize("name", POLICIES)
def test_canonical_spec_round_trips_with_options_in_declaration_order(name):
    cls = DECODE_POLICIES[name]
    values = {}
    for f in _options(cls):
        values[f.name] = _set_one(cls, f)[0]
        try:
            cls(**values)
        except InputError:  # a value fine alone but not with the others: leave it out
            del values[f.name]
    obj = cls(**values)
    assert obj.spec == f"{name}({','.join(f'{k}={format_value(v)}' for k, v in values.items())})"
    assert make_policy(obj.spec) == obj
    spaced = f"{name}( {', '.join(f'{k} = {format_value(v)}' for k, v in reversed(values.items()))} )"
    assert make_policy(spaced) == obj  # whitespace and order are free; the canonical spec is not


@pytest.mark.parametrize("name", POLICIES)
def test_unknown_option_names_the_valid_ones(name):
    with pytest.raises(BadDecodeOption) as e:
        make_policy(f"{name}(bogus=1)")
    assert "'bogus'" in str(e.value) and all(f.name in str(e.value) for f in _options(DECODE_POLICIES[name]))
    assert (e.value.code, e.value.param) == ("invalid_decode", "decode")
    with pytest.raises(BadDecodeOption, match="unknown option 'bogus'"):
        make_policy(name, bogus=1)
    with pytest.raises(BadDecodeOption, match="window must be an integer"):
        make_policy(f"{name}(window=wide)")
    with pytest.raises(BadDecodeOption, match="kv_budget must be a positive integer"):
        make_policy(f"{name}(kv_budget=0)")


def test_unknown_policies_and_bad_syntax_are_typed_errors_naming_the_valid_ones():
    with pytest.raises(UnknownDecodePolicy) as e:
        make_policy("zzz(window=3)")
    assert all(n in str(e.value) for n in POLICIES) and "full = dense" in str(e.value)
    with pytest.raises(UnknownDecodePolicy):
        make_policy(3)
    with pytest.raises(BadDecodeOption, match="decode policy spec 'prkv\\(': expected"):
        make_policy("prkv(")  # the method grammar's syntax error, as the decode error type
    with pytest.raises(BadDecodeOption, match="group_reduce must be one of max, mean, sum, softmax"):
        make_policy("prkv(group_reduce=median)")
    assert make_policy("prkv(static_ratio=1)").static_ratio == 1.0  # an integer for a number: a float


def test_full_is_the_alias_of_dense_and_the_one_dense_predicate():
    assert make_policy("full") == make_policy("dense") == Dense() == make_policy()
    assert make_policy("full(window=32)") == Dense(window=32) and make_policy("full").spec == "dense"
    assert is_dense("full") and is_dense("dense") and is_dense(Dense()) and is_dense("dense(kv_budget=4)")
    assert not any(is_dense(p) for p in SPARSE) and not is_dense(PRKV(kv_budget=64))


def test_kv_budget_the_policys_else_the_requests_else_the_default():
    assert policy_budget(PRKV(kv_budget=256), None) == 256 and policy_budget(PRKV(), 300) == 300
    assert policy_budget(PRKV(), None) == 1024 and policy_budget(PRKV(kv_budget=256), 256) == 256
    with pytest.raises(BadDecodeOption, match="two kv budgets") as e:
        policy_budget(PRKV(kv_budget=256), 300)
    assert e.value.param == "kv_budget"
    dec = make_decoder("prkv:kv_budget=256", num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16)
    assert dec.kv_budget == 256 and dec.policy == PRKV(kv_budget=256)
    assert make_decoder(Quest(), 512, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16).kv_budget == 512


# ---- the adaptive budget -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(AutoBudget)])
def test_every_auto_option_as_a_spec_builds_the_object_built_directly(field):
    f = next(x for x in dataclasses.fields(AutoBudget) if x.name == field)
    value, direct = _set_one(AutoBudget, f)
    text = format_value(list(value) if isinstance(value, tuple) else value)
    for spec in (f"auto({field}={text})", f"auto:{field}={text}", f"AUTO ( {field} = {text} )"):
        assert AutoBudget.of(spec) == direct and ratio_value(spec) == direct
        assert parse_ratio(spec) == AUTO and split_ratio(spec) == (AUTO, direct)
    assert direct.spec == f"auto({field}={text})" and AutoBudget.of(direct.spec) == direct
    assert AutoBudget().spec == "auto" and ratio_value("auto") == AUTO  # "auto" alone: the engine's defaults


def test_auto_budget_errors_name_the_valid_options_and_two_budgets_are_refused():
    with pytest.raises(BadAutoOption) as e:
        ratio_value("auto(bogus=1)")
    assert all(f.name in str(e.value) for f in dataclasses.fields(AutoBudget)) and e.value.param == "auto"
    with pytest.raises(BadAutoOption, match="verify_by must be one of bm25, attention, order"):
        ratio_value("auto(verify_by=nearest)")
    with pytest.raises(BadAutoOption, match="schedule"):
        ratio_value("auto(schedule=[0.2,0.1])")
    with pytest.raises(BadRatio, match="recompute_ratio must be a number in \\[0, 1\\] or 'auto'"):
        ratio_value("automatic")
    assert split_ratio(AutoBudget(tol=0.05), {"tol": 0.05}) == (AUTO, AutoBudget(tol=0.05))
    assert split_ratio("auto", {"tol": 0.05}) == (AUTO, {"tol": 0.05}) and split_ratio(0.2) == (0.2, None)
    with pytest.raises(BadAutoOption, match="two auto budgets"):
        split_ratio("auto(tol=0.05)", {"tol": 0.02})
    assert AutoBudget(schedule=0.1) == AutoBudget.of("auto(schedule=[0.1])")  # one round, as a number or a list


# ---- on a tiny model: a spec and its object give the same answer and stats ---------------------------------
@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    for chunks in (CHUNKS, AUTO_CHUNKS):  # stored: every compared run reads the chunks from the store alike
        eng.generate(SAMPLE_QUESTION, chunks, method="naive", max_new_tokens=1)
    return eng


@pytest.mark.parametrize("name", SPARSE)
def test_spec_string_and_object_decode_the_same_with_the_policys_budget(engine, name):
    obj = dataclasses.replace(DECODE_POLICIES[name](), window=16, kv_budget=48)
    spec = f"{name}(window=16,kv_budget=48)"
    runs = [engine.generate(SAMPLE_QUESTION, CHUNKS, method="random", recompute_ratio=0.3, max_new_tokens=6,
                            decode=d, decode_options={"page_size": 8}) for d in (spec, obj)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) > 1
    assert _stable(runs[0].stats) == _stable(runs[1].stats)
    st = runs[0].stats
    assert st.decode_policy == obj.spec and make_policy(st.decode_policy) == obj
    assert st.kv_budget == 48 and st.decoder["kv_budget"] == 48  # the policy's own budget is the decoder's
    with pytest.raises(BadDecodeOption, match="two kv budgets"):
        engine.generate(SAMPLE_QUESTION, CHUNKS, method="random", decode=obj, kv_budget=64)


def test_dense_full_and_the_default_decode_alike(engine):
    runs = [engine.generate(SAMPLE_QUESTION, CHUNKS, method="random", recompute_ratio=0.3, max_new_tokens=6,
                            **({} if d is None else {"decode": d})) for d in (None, "dense", "full", Dense())]
    assert all(r.token_ids == runs[0].token_ids for r in runs)
    assert all(r.stats.decode_policy == "dense" and r.stats.decoder is None for r in runs)
    with pytest.raises(InputError, match="decode='dense' takes none"):
        engine.generate(SAMPLE_QUESTION, CHUNKS, method="random", decode="full", decode_options={"page_size": 8})


def test_auto_budget_object_spec_and_options_run_alike(engine):
    opts = {"min_context": 0, "tol": 0.05, "schedule": [0.1, 0.3]}
    obj = AutoBudget(**opts)
    runs = [engine.generate(SAMPLE_QUESTION, AUTO_CHUNKS, method="prophet", max_new_tokens=6, **kw) for kw in (
        {"recompute_ratio": obj}, {"recompute_ratio": obj.spec}, {"recompute_ratio": AutoBudget.of(opts)},
        {"recompute_ratio": "auto:min_context=0,tol=0.05,schedule=[0.1,0.3]"})]
    assert obj.spec == "auto(schedule=[0.1,0.3],tol=0.05,min_context=0)"
    assert all(r.token_ids == runs[0].token_ids for r in runs)
    assert all(_stable(r.stats) == _stable(runs[0].stats) for r in runs)
    st = runs[0].stats
    assert st.ratio == "auto" and st.auto_spec == obj.spec and st.rounds >= 1
    pre = engine.prefill(engine.layout(SAMPLE_QUESTION, AUTO_CHUNKS), "prophet", obj, 6)  # the driving callers
    assert pre.stats["auto_spec"] == obj.spec and pre.greedy == runs[0].token_ids[:len(pre.greedy)]


# ---- every surface takes the specs -------------------------------------------------------------------------
def test_server_request_takes_decode_and_auto_specs(engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": SAMPLE_QUESTION}], "documents": CHUNKS,
            "max_tokens": 5}
    defaults = ChatDefaults.of("random", 0.2, "full")
    req = parse_chat_body({**body, "decode": "prkv:kv_budget=64", "ratio": "auto(tol=0.05)"}, defaults)
    assert (req.decode, req.ratio, req.auto) == (PRKV(kv_budget=64), "auto", AutoBudget(tol=0.05))
    assert parse_chat_body(body, defaults).decode.spec == "dense"
    run = req.generation(CHUNKS)  # the engine's request: the objects themselves, nothing to parse again
    assert (run.decode, run.recompute_ratio, run.auto, run.checked) == (req.decode, req.auto, None, True)
    app_ = create_app(engine, default_method="random", default_ratio=0.3, model_name="tiny", default_decode="full")
    with ServerThread(app_) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        ok = c.post("/v1/chat/completions", json={**body, "decode": "quest(kv_budget=128)"})
        alone = engine.generate(messages=body["messages"], chunks=CHUNKS, method="random", recompute_ratio=0.3,
                                max_new_tokens=5, decode=Quest(kv_budget=128))
        assert ok.status_code == 200, ok.text
        assert ok.json()["kvstitch"]["decode"] == "quest(kv_budget=128)"
        assert ok.json()["choices"][0]["message"]["content"] == alone.text
        assert c.get("/v1/models").json()["data"][0]["kvstitch"]["default_decode"] == "dense"
        for extra, param, text in [({"decode": "prkv(bogus=1)"}, "decode", "unknown option 'bogus'"),
                                   ({"decode": "prkv:kv_budget=64", "kv_budget": 32}, "kv_budget", "two kv budgets"),
                                   ({"ratio": "auto(bogus=1)"}, "ratio", "unknown auto option"),
                                   ({"decode": "zzz"}, "decode", "unknown decode policy 'zzz'")]:
            bad = c.post("/v1/chat/completions", json={**body, **extra})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
            assert text in bad.json()["error"]["message"]


def test_config_file_decode_as_spec_or_table(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('ratio = "auto(tol=0.05)"\n[decode]\nname = "prkv"\nstatic_ratio = 0.5\n')
    assert read_config(cfg, {"decode", "ratio"})["decode"] == "prkv(static_ratio=0.5)"
    assert read_answer_settings(cfg) == {"ratio": "auto(tol=0.05)", "decode": "prkv(static_ratio=0.5)"}
    cfg.write_text('decode = "full"\n')
    assert read_config(cfg, {"decode"}) == {"decode": "dense"}
    cfg.write_text('[decode]\nstatic_ratio = 0.5\n')
    with pytest.raises(InputError, match="decode table needs a 'name'"):
        read_config(cfg, {"decode"})


def test_eval_and_calibrate_lists_take_auto_specs():
    ratios, auto = parse_ratios("0.1,auto(tol=0.05,schedule=[0.1,0.2]),0.2", {"mode": "incremental"})
    assert ratios == [0.1, "auto", 0.2] and AutoBudget.of(auto) == AutoBudget(tol=0.05, schedule=(0.1, 0.2),
                                                                                  mode="incremental")
    assert parse_ratios("0.1,auto", {"tol": 0.02}) == ([0.1, "auto"], {"tol": 0.02})
    with pytest.raises(BadAutoOption, match="one auto setting per run"):
        parse_ratios("auto(tol=0.05),auto(tol=0.02)")
    with pytest.raises(BadAutoOption, match="set tol differently"):
        parse_ratios("auto(tol=0.05)", {"tol": 0.02})
    assert parse_auto("auto(schedule=[0.05,0.1],tol=0.02)") == parse_auto("schedule=0.05/0.1,tol=0.02")
    with pytest.raises(BadAutoOption, match="unknown auto option"):
        parse_auto("auto:bogus=1")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, engine, smollm_tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama")
    engine.model.save_pretrained(str(d))
    smollm_tokenizer.save_pretrained(str(d))
    return d


def test_cli_ask_takes_decode_and_ratio_specs(tiny_model_dir, tmp_path):
    paths = []
    for i, text in enumerate(CHUNKS):
        paths += ["--chunk", str(tmp_path / f"c{i}.txt")]
        (tmp_path / f"c{i}.txt").write_text(text)
    runner = CliRunner()
    r = runner.invoke(app, ["ask", SAMPLE_QUESTION, *paths, "--model", str(tiny_model_dir), "--method", "random",
                            "--ratio", "auto(min_context=0,schedule=[0.2])", "--decode", "quest(kv_budget=64)",
                            "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "auto:" in r.output  # the budget note of an adaptive run
    for args, message in [(["--decode", "prkv(bogus=1)"], "unknown option 'bogus'"),
                          (["--ratio", "auto(tol=-1)"], "auto: tol must be a finite number >= 0")]:
        r = runner.invoke(app, ["ask", SAMPLE_QUESTION, *paths, "--model", str(tiny_model_dir), *args])
        assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_bench_decode_labels_rows_by_canonical_spec(engine):
    from kvstitch.bench.decode import bench_decode_model

    rows, meta = bench_decode_model(engine, context=300, budgets=[96], n_niah=0, new_tokens=2, progress=False,
                                    page_size=8, policies=["full", "prkv(static_ratio=0.5)", "quest"])
    assert [r["policy"] for r in rows] == ["dense", "floor", "prkv(static_ratio=0.5)", "quest"]
    assert meta["policies"] == ["prkv(static_ratio=0.5)", "quest"]
    with pytest.raises(InputError, match="sets kv_budget"):
        bench_decode_model(engine, context=300, budgets=[96], n_niah=0, policies=["prkv:kv_budget=96"],
                           progress=False)

