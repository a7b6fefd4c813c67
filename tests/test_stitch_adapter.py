"""The stitch adapter (`kvstitch.models.stitch_adapter`): attached to a tiny model it changes stitched reads only,
leaves passage caches and full prefill alone, survives a file round trip and refuses files of other models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstitch import Engine
from kvstitch.engine.batch import DecodeStep
from kvstitch.engine.budget import AutoBudget
from kvstitch.models.stitch_adapter import (ATTENTION_TARGETS, LORA_TARGETS, MLP_TARGETS, GatedLoRA, StitchAdapter,
                                            StitchAdapterConfig, StitchAdapterError, gated, resolve_adapter)

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, new_tiny_engine

ATOL = 1e-3


def fresh_engine(tokenizer, name: str = "llama") -> Engine:
    """A tiny engine of its own (attaching an adapter wraps its model's modules)."""
    return new_tiny_engine(name, tokenizer)


def active_adapter(eng: Engine, links: int = 4, rank: int = 4, seed: int = 1) -> StitchAdapter:
    """An adapter whose LoRA is not the identity (B random), so it really changes what it reads."""
    ad = StitchAdapter.for_model(eng.model, eng.weights_id, StitchAdapterConfig(links=links, rank=rank))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in ad.lora_b.values():
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return ad


@pytest.fixture(scope="module")
def eng(smollm_tokenizer):
    return fresh_engine(smollm_tokenizer)


def gen(eng, method="random", ratio=0.0, **kw):
    return eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, method=method, recompute_ratio=ratio,
                        max_new_tokens=kw.pop("max_new_tokens", 6), **kw)


def test_off_is_bit_for_bit_today_and_full_prefill_never_reads_through_it(eng):
    runs = {"naive": 0.0, "random": 0.3, "full": 0.0}
    before = {m: gen(eng, m, r) for m, r in runs.items()}
    eng.use_stitch_adapter(active_adapter(eng))
    try:
        with_full = gen(eng, "full")
        assert torch.equal(with_full.first_logits, before["full"].first_logits)
        assert with_full.token_ids == before["full"].token_ids
        adapted = gen(eng, "naive")
        assert (adapted.first_logits - before["naive"].first_logits).abs().max() > 1e-3  # it acts
        assert adapted.stats.to_dict().get("stitch_adapter") == "links=4+lora(r=4)"
    finally:
        eng.use_stitch_adapter(None)
    for m, res in before.items():
        again = gen(eng, m, runs[m])
        assert torch.equal(again.first_logits, res.first_logits), m  # detached: exactly as before
        assert again.token_ids == res.token_ids


def test_full_recompute_with_adapter_is_full_prefill_and_guard_returns_full_prefills_answer(eng):
    full = gen(eng, "full")
    eng.use_stitch_adapter(active_adapter(eng))
    try:
        all_tokens = gen(eng, "random", 1.0)
        assert (all_tokens.first_logits - full.first_logits).abs().max().item() <= ATOL
        assert all_tokens.token_ids == full.token_ids
        guarded = gen(eng, "random", 0.2, guard="full")
        assert guarded.token_ids == full.token_ids
    finally:
        eng.use_stitch_adapter(None)


def test_passage_caches_are_shared_with_and_without_the_adapter(eng):
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    keys = [eng.chunk_key(layout.prefix_ids, c) for c in layout.chunk_ids]
    gen(eng, "naive")  # stores every passage
    eng.use_stitch_adapter(active_adapter(eng))
    try:
        assert [eng.chunk_key(layout.prefix_ids, c) for c in layout.chunk_ids] == keys
        res = gen(eng, "random", 0.2)
        assert res.stats.store_hits == len(SAMPLE_CHUNKS) and res.stats.store_misses == 0
    finally:
        eng.use_stitch_adapter(None)


def test_link_tokens_sit_between_passages_and_question_and_are_recomputed(eng):
    eng.use_stitch_adapter(active_adapter(eng, links=3, rank=0))
    try:
        pre = eng.prefill(eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), "random", 0.0, max_new_tokens=4)
        lay = pre.layout
        assert lay.links == 3 and lay.suffix_ids[:3].tolist() == list(range(eng.vocab_size, eng.vocab_size + 3))
        assert torch.equal(lay.without_links().suffix_ids, eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS).suffix_ids)
        # their K/V were computed (the stitched cache had zeros there)
        assert pre.cache.layers[0].keys[0, :, lay.context_end:lay.context_end + 3].abs().sum() > 0
    finally:
        eng.use_stitch_adapter(None)


def test_composes_with_auto_sparse_decode_and_methods(eng):
    eng.use_stitch_adapter(active_adapter(eng))
    try:
        for method in ("deltaprop(base=infoflow)", "prophet", "cacheblend"):
            assert gen(eng, method, 0.2).token_ids
        res = gen(eng, "prophet", AutoBudget(min_context=1, schedule=(0.1, 0.2)))
        assert res.token_ids and res.stats.to_dict().get("stitch_adapter")
        assert gen(eng, "prophet", 0.2, decode="prkv(kv_budget=64)").token_ids
    finally:
        eng.use_stitch_adapter(None)


def test_recomputed_passage_tokens_do_not_read_through_the_adapter(eng):
    """Recompute gives the selected passage tokens fresh K/V; the adapter is for the tokens after the passages."""
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    plain = eng.prefill(layout, "random", 0.4, max_new_tokens=2)
    eng.use_stitch_adapter(active_adapter(eng))
    try:
        adapted = eng.prefill(layout, "random", 0.4, max_new_tokens=2)
    finally:
        eng.use_stitch_adapter(None)
    assert torch.equal(plain.indices, adapted.indices)
    slots = plain.indices + layout.context_start
    for lp, la in zip(plain.cache.layers, adapted.cache.layers):
        assert (lp.keys[0, :, slots] - la.keys[0, :, slots]).abs().max().item() < 1e-5
        assert (lp.values[0, :, slots] - la.values[0, :, slots]).abs().max().item() < 1e-5
    end = layout.context_end  # the question does read through it
    q = adapted.cache.layers[-1].values[0, :, end + adapted.layout.links:end + adapted.layout.links + 3]
    assert (plain.cache.layers[-1].values[0, :, end:end + 3] - q).abs().max().item() > 1e-4


def test_batched_decode_gates_each_row_by_its_own_cache(eng):
    """A batch of an adapted request and a plain one: each row as its own lone step computes it."""
    eng.use_stitch_adapter(active_adapter(eng))
    try:
        a = eng.prefill(eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), "random", 0.2, max_new_tokens=4)
        b = eng.prefill(eng.layout("Who lives in Rome?", SAMPLE_CHUNKS), "full", 0.0, max_new_tokens=4)
        assert a.cache.adapted and not b.cache.adapted
        ta, tb = int(a.logits[-1].argmax()), int(b.logits[-1].argmax())
        lone = [eng.decode_step(a.cache, ta), eng.decode_step(b.cache, tb)]
        for p in (a, b):
            p.cache.truncate(p.layout.n_total)
        both = eng.decode_batch([DecodeStep(a.cache, ta), DecodeStep(b.cache, tb)])
        for x, y in zip(lone, both):
            assert (x - y).abs().max().item() < 1e-4
        with gated(None):  # and the adapted row does differ from an ungated one
            a.cache.truncate(a.layout.n_total)
            a.cache.adapted = False
            plain = eng.decode_step(a.cache, ta)
        assert (plain - lone[0]).abs().max().item() > 1e-4
    finally:
        eng.use_stitch_adapter(None)


def test_a_packed_recompute_pass_gates_each_segment_by_its_own_cache(eng):
    """The batching server packs passes of requests with and without the adapter: each as alone."""
    from kvstitch.engine.prefill import recompute_step
    from kvstitch.engine.stitch import stitch, with_adapter

    eng.use_stitch_adapter(active_adapter(eng))
    try:
        def step(question, adapted):
            lay = eng.layout(question, SAMPLE_CHUNKS)
            kvs = eng.chunk_kvs(lay)
            lay, on = with_adapter(eng, lay, 0.2 if adapted else 1.0)
            cache = stitch(eng, lay, kvs, extra=4, adapted=on)
            return recompute_step(cache, lay, torch.arange(0, lay.n_context, 3))

        lone = [eng.recompute_batch([step(SAMPLE_QUESTION, True)])[0],
                eng.recompute_batch([step("Who lives in Rome?", False)])[0]]
        packed = eng.recompute_batch([step(SAMPLE_QUESTION, True), step("Who lives in Rome?", False)])
        for x, y in zip(lone, packed):
            assert (x - y).abs().max().item() < 1e-4
        assert (lone[0] - eng.recompute_batch([step(SAMPLE_QUESTION, False)])[0]).abs().max().item() > 1e-4
    finally:
        eng.use_stitch_adapter(None)


SHIPPED = Path(__file__).resolve().parent.parent / "kvstitch" / "data" / "adapters"


def test_file_round_trip_is_bit_identical(eng, tmp_path):
    ad = active_adapter(eng)
    path = ad.save(tmp_path / "a.safetensors")
    back = StitchAdapter.load(path)
    assert back.config == ad.config and back.weights_id == eng.weights_id
    assert list(back.state_dict()) == list(ad.state_dict())  # same order: an optimizer's state follows it
    for k, v in ad.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert back.digest() == ad.digest()
    assert resolve_adapter(str(path)).digest() == ad.digest()
    assert resolve_adapter("none") is None and resolve_adapter(None) is None


def test_bad_files_and_other_models_are_one_clear_error(eng, tmp_path, smollm_tokenizer):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(StitchAdapterError, match="not a readable stitch adapter"):
        StitchAdapter.load(bad)
    with pytest.raises(StitchAdapterError, match="no stitch adapter file"):
        resolve_adapter(str(tmp_path / "missing.safetensors"))
    other = fresh_engine(smollm_tokenizer, "qwen2")
    path = active_adapter(other).save(tmp_path / "qwen.safetensors")
    with pytest.raises(StitchAdapterError) as err:
        eng.use_stitch_adapter(StitchAdapter.load(path))
    assert "tiny-qwen2" in str(err.value) and "tiny-llama" in str(err.value)
    assert eng.stitch_adapter is None
    with pytest.raises(StitchAdapterError, match="ships no stitch adapter for gemma3"):
        resolve_adapter("default", "gemma3")


def test_auto_is_the_shipped_adapter_only_where_its_card_turns_it_on(tmp_path, monkeypatch):
    import inspect
    import json

    from kvstitch.models import stitch_adapter as sa

    assert inspect.signature(Engine.load).parameters["stitch_adapter"].default == "auto"
    assert sa.on_by_default("qwen2.5-0.5b") and sa.on_by_default("qwen2.5-1.5b") and not sa.on_by_default("smollm2")
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        assert resolve_adapter("auto", name).digest() == resolve_adapter("default", name).digest()
    assert resolve_adapter("auto", "smollm2") is None  # shipped, but not measured better on its report runs
    assert resolve_adapter("auto", "gemma3") is None and resolve_adapter("auto", str(tmp_path / "m.gguf")) is None
    assert resolve_adapter("auto") is None  # the default model (SmolLM2)
    # the card alone decides: turn SmolLM2's on in a copy of the shipped directory
    monkeypatch.setattr(sa, "SHIPPED_DIR", tmp_path)
    for f in ("smollm2.safetensors", "smollm2.json"):
        (tmp_path / f).write_bytes((SHIPPED / f).read_bytes())
    card = json.loads((tmp_path / "smollm2.json").read_text())
    (tmp_path / "smollm2.json").write_text(json.dumps({**card, "on_by_default": True}))
    assert resolve_adapter("auto", "smollm2").digest() == resolve_adapter("default", "smollm2").digest()


def test_config_checks():
    with pytest.raises(ValueError, match="needs link tokens"):
        StitchAdapterConfig(links=0, rank=0)
    with pytest.raises(ValueError, match="unknown LoRA target"):
        StitchAdapterConfig(targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="adapts no projection"):
        StitchAdapterConfig(links=0, rank=0, writer=4, targets=())
    assert StitchAdapterConfig(links=8, rank=0).form == "links=8"


def test_shipped_adapters_name_their_model_and_how_they_were_made():
    import json

    from kvstitch.models.loader import _GGUF_SHA256
    from kvstitch.models.stitch_adapter import SHIPPED_DIR, shipped_adapters

    assert {"smollm2", "qwen2.5-0.5b", "qwen2.5-1.5b"} <= set(shipped_adapters())
    for name in shipped_adapters():
        ad = resolve_adapter("default", name)
        ad.check_model(f"gguf:{_GGUF_SHA256[name]}", name)  # trained for this embedded model's weights
        made = json.loads((SHIPPED_DIR / f"{name}.json").read_text())
        assert made["command"].startswith("kvstitch adapt") and made["steps"] >= 1 and made["cpu_hours"] > 0
        assert ad.info["steps"] == made["steps"]


def test_every_generating_command_and_the_server_config_take_a_stitch_adapter(tmp_path):
    import typer

    from kvstitch.cli.main import app
    from kvstitch.serve.config import read_config

    root = typer.main.get_command(app)
    serving = {k: root.commands[k] for k in ("ask", "demo", "serve", "precompute", "index", "viz")}
    measuring = {"eval": root.commands["eval"], "calibrate": root.commands["calibrate"],
                 **{f"bench {k}": v for k, v in root.commands["bench"].commands.items()
                    if k in ("ttft", "serve", "decode")}}
    defaults = {name: {p.name: p.default for p in cmd.params}
                for name, cmd in {**serving, **measuring}.items()}
    for name in serving:  # what a user gets: the shipped adapter where it measured better
        assert defaults[name].get("stitch_adapter", "missing") == "auto", name
    for name in measuring:  # a recorded measurement command keeps measuring the same thing
        assert defaults[name].get("stitch_adapter", "missing") is None, name
    cfg = tmp_path / "kvstitch.toml"
    cfg.write_text('stitch_adapter = "default"\n')
    known = {p.name for p in root.commands["serve"].params if p.name != "config"}
    assert read_config(cfg, known)["stitch_adapter"] == "default"


def test_the_strength_schedule_interpolates_and_enters_the_digest(eng):
    ad = active_adapter(eng)
    plain = ad.digest()
    assert ad.strength_at(0.0) == 1.0 and ad.strength_at(0.7) == 1.0  # no schedule: full strength
    ad.info["strength"] = [[0.0, 1.0], [0.1, 0.5], [0.2, 0.0]]
    assert [ad.strength_at(r) for r in (0.0, 0.05, 0.1, 0.15, 0.2, 0.9)] == pytest.approx([1, 0.75, 0.5, 0.25, 0, 0])
    assert ad.digest() != plain


def test_strength_scales_the_lora_and_zero_is_the_plain_stitched_cache(eng):
    """At a ratio its schedule turns off, the adapter is not there at all (bit for bit); in between, the LoRA's
    change to the question's values is scaled by the strength (linear in the gate, to first order exactly)."""
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    plain = eng.prefill(layout, "naive", 0.0, max_new_tokens=2)
    ad = active_adapter(eng, links=0)
    eng.use_stitch_adapter(ad)
    try:
        ad.info["strength"] = [[0.0, 0.0]]
        off = eng.prefill(layout, "naive", 0.0, max_new_tokens=2)
        assert torch.equal(off.logits, plain.logits) and off.cache.adapted == 0 and not off.layout.links
        assert off.stats.get("stitch_adapter") is None
        deltas = {}
        for s in (0.5, 1.0):
            ad.info["strength"] = [[0.0, s]]
            pre = eng.prefill(layout, "naive", 0.0, max_new_tokens=2)
            assert pre.cache.adapted == s
            end = layout.context_end  # the first layer's values of the question: v_proj(x) + s * LoRA(x)
            deltas[s] = pre.cache.layers[0].values[0, :, end:end + 3] - plain.cache.layers[0].values[0, :, end:end + 3]
        assert deltas[1.0].abs().max() > 1e-4
        assert (deltas[0.5] * 2 - deltas[1.0]).abs().max() < 1e-5
    finally:
        eng.use_stitch_adapter(None)


def writer_adapter(eng: Engine, seed: int = 2, links: int = 0, rank: int = 0) -> StitchAdapter:
    """An adapter whose writer LoRA is not the identity."""
    ad = StitchAdapter.for_model(eng.model, eng.weights_id, StitchAdapterConfig(links=links, rank=rank, writer=4))
    gen_ = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in ad.writer_b.values():
            b.copy_(0.05 * torch.randn(b.shape, generator=gen_))
    return ad


def test_an_adapter_that_changes_precompute_enters_the_store_key(eng):
    """A writer's caches get a key of their own (its weights' digest), so they never mix with plain ones or with
    another writer's; the reader and link tokens stay out of the key (passage caches are shared)."""
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    plain = [eng.chunk_key(layout.prefix_ids, c) for c in layout.chunk_ids]
    gen(eng, "naive")  # plain caches stored
    ad = writer_adapter(eng)
    eng.use_stitch_adapter(ad)
    try:
        written = [eng.chunk_key(layout.prefix_ids, c) for c in layout.chunk_ids]
        assert not set(written) & set(plain)
        res = gen(eng, "naive")
        assert res.stats.store_misses == len(SAMPLE_CHUNKS)  # never a plain cache
        assert gen(eng, "naive").stats.store_hits == len(SAMPLE_CHUNKS)  # its own, once written
        with torch.no_grad():
            next(iter(ad.lora_a.values()), torch.zeros(1)).add_(0)  # (no reader here: nothing to change)
            next(iter(ad.writer_b.values())).add_(0.01)
        assert [eng.chunk_key(layout.prefix_ids, c) for c in layout.chunk_ids] != written  # other weights
    finally:
        eng.use_stitch_adapter(None)
    assert [eng.chunk_key(layout.prefix_ids, c) for c in layout.chunk_ids] == plain


def test_the_writer_acts_at_precompute_only(eng):
    """Passages written through it differ from plain ones; full prefill and the question's own pass do not
    read through it."""
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    full = gen(eng, "full")
    plain = eng.compute_chunks(layout.prefix_ids, layout.chunk_ids)
    eng.use_stitch_adapter(writer_adapter(eng))
    try:
        assert torch.equal(gen(eng, "full").first_logits, full.first_logits)
        written = eng.compute_chunks(layout.prefix_ids, layout.chunk_ids)
        assert (written[0].values - plain[0].values).abs().max() > 1e-4
        # the training path writes the same K/V (with gradients)
        from kvstitch.adapt.distill import written_chunks

        with torch.no_grad():
            trained = written_chunks(eng, layout)
        for a, b in zip(trained, written):
            assert (a.keys - b.keys).abs().max() < 1e-4 and (a.values - b.values).abs().max() < 1e-4
    finally:
        eng.use_stitch_adapter(None)


def test_a_writer_adapter_survives_a_file_round_trip(eng, tmp_path):
    ad = writer_adapter(eng, links=2, rank=2)
    back = StitchAdapter.load(ad.save(tmp_path / "w.safetensors"))
    assert back.config == ad.config and back.config.form == "links=2+lora(r=2)+writer(r=4)"
    assert back.precompute_tag() == ad.precompute_tag() and back.digest() == ad.digest()
    plain = active_adapter(eng)
    assert plain.precompute_tag() == "" and "writer" not in plain.config.identity()



def test_a_writer_on_the_mlps_too_wraps_them_and_writes_other_caches(eng, tmp_path):
    """``targets`` with the MLP's projections: the LoRA wraps them too, starts as the identity (B = 0: the plain
    caches, bit for bit), writes other K/V once the MLP's B moves, and loads back with the same digest and key."""
    assert StitchAdapterConfig().targets == ATTENTION_TARGETS  # the default, so older adapters keep their digest
    ad = StitchAdapter.for_model(eng.model, eng.weights_id, StitchAdapterConfig(links=0, rank=0, writer=4,
                                                                               targets=LORA_TARGETS))
    layers = eng.model.model.layers
    assert len(ad.writer_a) == len(LORA_TARGETS) * len(layers)
    layout = eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    plain = eng.compute_chunks(layout.prefix_ids, layout.chunk_ids)
    eng.use_stitch_adapter(ad)
    try:
        assert all(isinstance(getattr(layers[0].mlp, t), GatedLoRA) for t in MLP_TARGETS)
        same = eng.compute_chunks(layout.prefix_ids, layout.chunk_ids)
        assert all(torch.equal(a.values, b.values) and torch.equal(a.keys, b.keys) for a, b in zip(same, plain))
        gen_ = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for k, b in ad.writer_b.items():
                if k.split("_", 1)[1] in MLP_TARGETS:  # the MLP's LoRA alone
                    b.copy_(0.05 * torch.randn(b.shape, generator=gen_))
        written = eng.compute_chunks(layout.prefix_ids, layout.chunk_ids)
        assert (written[0].values - plain[0].values).abs().max() > 1e-4
    finally:
        eng.use_stitch_adapter(None)
    assert not isinstance(layers[0].mlp.down_proj, GatedLoRA)
    back = StitchAdapter.load(ad.save(tmp_path / "mlp.safetensors"))
    assert back.config.targets == LORA_TARGETS and list(back.state_dict()) == list(ad.state_dict())
    assert back.digest() == ad.digest() and back.precompute_tag() == ad.precompute_tag()


# cacheclip needs its auxiliary model; full never reads through the adapter (tested above)
ADAPTED_METHODS = ["naive", "random", "cacheblend", "epic", "kvshare", "a3", "ape", "grouped", "infoflow", "prophet",
                   "qcfuse", "oracle", "deltaprop(base=infoflow)", "deltaprop(base=prophet)"]


@pytest.mark.parametrize("method", ADAPTED_METHODS)
def test_every_method_reads_through_the_adapter_at_its_ratio_strength(eng, method):
    """Whatever cache a method ends with (reordered, wrapped), the question and the answer still read through the
    adapter, at the strength its schedule gives the ratio (naive and APE: ratio 0's)."""
    ad = active_adapter(eng)
    ad.info["strength"] = [[0.0, 1.0], [0.2, 0.5]]
    eng.use_stitch_adapter(ad)
    try:
        pre = eng.prefill(eng.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), method, 0.1, max_new_tokens=2)
        zero = pre.selector.zero_budget if hasattr(pre.selector, "zero_budget") else method in ("naive", "ape")
        assert pre.cache.adapted == pytest.approx(1.0 if zero else 0.75), method
        assert pre.cache.adapt_from == pre.layout.context_end and pre.layout.links == 4
    finally:
        eng.use_stitch_adapter(None)


@pytest.mark.parametrize("method,ratio", [("naive", None), ("random", 0.3)])
def test_the_eval_reads_an_adapted_prompt_as_generate_does(eng, method, ratio):
    """The eval's one-prefill run over a prompt that gained link tokens: the greedy answer `generate` gives and the
    logits `answer_logits` gives (the answer starts after the link tokens, not where the plain prompt ends)."""
    from kvstitch.eval.runner import run_method, sample_layout
    from kvstitch.tasks.tasks import Sample

    eng.use_stitch_adapter(active_adapter(eng))
    try:
        layout = sample_layout(eng, Sample(task="t", chunks=SAMPLE_CHUNKS, question=SAMPLE_QUESTION, answers=["x"],
                                           meta={}))
        target = torch.tensor(eng.generate("", [], method="full", max_new_tokens=8, layout=layout).token_ids)
        run = run_method(eng, layout, method, ratio, 8, target)
        got = eng.generate("", [], method=method, recompute_ratio=ratio or 0.0, max_new_tokens=8, layout=layout)
        assert run.stats.get("stitch_adapter") and run.tokens == got.token_ids
        logits, _, _ = eng.answer_logits(layout, target, method, ratio or 0.0)
        torch.testing.assert_close(run.logits, logits.float(), rtol=1e-4, atol=1e-4)
    finally:
        eng.use_stitch_adapter(None)
