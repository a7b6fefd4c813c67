"""The batched sparse attention of a decode step (`decode.batched.attend_batch`) against the per-row reference
(`SparseDecoder.attend`), and the GQA rule of the page choice (`group_reduce`)."""

import pytest
import torch

from kvstitch.decode import DECODE_POLICIES, append_kernel, kernel_common, make_decoder, paged_kernel, rank_kernel
from kvstitch.decode.batched import attend_batch
from kvstitch.decode.policies import GROUP_REDUCES, make_policy
from kvstitch.decode.recall import attention_recall
from kvstitch.decode.page_scores import bound_scores

HQ, HKV, D, P = 6, 2, 8, 4
SCALE = D ** -0.5
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))  # RoPE frequencies (ShadowKV un-rotates keys)
PAGED = sorted(set(DECODE_POLICIES) - {"shadowkv"})


def _decoder(policy, budget=16, layers=2, **kw):
    opts = {"sinks": 2, "window": 6, **kw}
    if policy in ("prkv", "snapkv"):
        opts.setdefault("refresh_interval", 3)  # refreshes restructure the cache during the test
    if policy == "arkvale":
        opts.pop("sinks")
    if policy == "shadowkv":
        opts = {"window": 6, "chunk_size": 4, "rank": 4, **kw}
    return make_decoder(policy, budget, num_layers=layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                        page_size=P, **opts)


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The batched attention through the paged kernel (CPU float32, numba) or the torch gather path."""
    if request.param == "kernel" and not paged_kernel.available():
        pytest.skip("numba (the kvstitch[fast] extra) not installed")
    monkeypatch.setattr(kernel_common, "ENABLED", request.param == "kernel")
    return request.param


class Twins:
    """Row i: the same random prefill and decode inputs fed to a reference decoder and a batched one."""

    def __init__(self, specs: list[tuple[str, dict]], lengths: list[int], sliding: int | None = 13, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.ref = [_decoder(p, **kw) for p, kw in specs]
        self.bat = [_decoder(p, **kw) for p, kw in specs]
        for ref, bat, n in zip(self.ref, self.bat, lengths):
            for layer in range(2):
                k, v, obs = self.randn(HKV, n, D), self.randn(HKV, n, D), self.randn(HQ, 6, D)
                sw = sliding if layer == 1 else None  # layer 1: a sliding-window layer (Gemma 3 style)
                ref.load_prefill(layer, k, v, obs, sliding_window=sw, inv_freq=INV_FREQ)
                bat.load_prefill(layer, k, v, obs, sliding_window=sw, inv_freq=INV_FREQ)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def step(self, rows: list[int]) -> float:
        """One decode step of ``rows`` (the others have finished): per layer the reference attends row by row,
        the twins in one `attend_batch` -> the largest output difference."""
        err = 0.0
        for layer in range(2):
            qs = []
            for i in rows:
                k, v, q = self.randn(HKV, 1, D), self.randn(HKV, 1, D), self.randn(HQ, 1, D)
                self.ref[i].append(layer, k, v)
                self.bat[i].append(layer, k, v)
                qs.append(q)
            want = [self.ref[i].attend(layer, q, SCALE) for i, q in zip(rows, qs)]
            got = attend_batch([self.bat[i] for i in rows], layer, qs, SCALE)
            for i, w, o in zip(rows, want, got):
                assert o.shape == w.shape == (HQ, 1, D)
                ref_sel, bat_sel = self.ref[i].layers[layer].selected, self.bat[i].layers[layer].selected
                assert torch.equal(ref_sel, bat_sel), (i, layer)  # same pages, same order
                err = max(err, (o - w).abs().max().item())
        for i in rows:
            self.ref[i].end_step()
            self.bat[i].end_step()
        return err

    def run(self, steps: list[int]) -> float:
        """Row i decodes ``steps[i]`` tokens (rows leave the batch as they finish) -> the largest difference."""
        err = 0.0
        for t in range(max(steps)):
            err = max(err, self.step([i for i, s in enumerate(steps) if t < s]))
        return err

    def check_stats(self) -> None:
        for ref, bat in zip(self.ref, self.bat):
            a, b = ref.stats(), bat.stats()
            for key in ("pages_read", "mean_selected_tokens", "static_refreshes", "steps", "pages_copied"):
                assert a[key] == b[key], key
            assert ref.selection_totals() == bat.selection_totals()


SPECS = [(p, {}) for p in PAGED] + [("quest", {"group_reduce": r}) for r in GROUP_REDUCES] + [
    ("prkv", {"group_reduce": "softmax"}), ("prkv", {"static_ratio": "auto"}), ("arkvale", {"kv_head_groups": 2}),
    ("prkv", {"digest": "moments"}), ("quest", {"digest": "moments", "group_reduce": "softmax"}),
    ("prkv", {"rerank_interval": 3}), ("quest", {"rerank_interval": 2, "digest": "moments"})]


@pytest.mark.parametrize("policy,options", SPECS, ids=[f"{p}-{'-'.join(map(str, o.values()))}" for p, o in SPECS])
def test_batched_attention_equals_each_row_alone(policy, options, path, monkeypatch):
    """Four ragged rows of one policy (selection really happens: 22 of 40-95 tokens), rows ending at different
    steps, static refreshes every 3 steps: same pages as each row alone, outputs within float rounding. On the
    kernel path a policy whose ranking has a kernel form builds its tables inside the kernel call."""
    calls = []
    real = paged_kernel.select_attend_rows
    monkeypatch.setattr(paged_kernel, "select_attend_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    tw = Twins([(policy, options)] * 4, [40, 57, 77, 95], seed=1)
    assert tw.run([9, 4, 12, 7]) < 1e-5
    tw.check_stats()
    if path == "kernel" and rank_kernel.rank_ok(tw.bat[0].policy, "cpu"):
        assert len(calls) == 12 * 2  # every step (12) and layer (2)


def test_mixed_policies_in_one_batch_with_fallback_rows(path):
    """Every policy in one step, plus rows the batched path hands to the per-row one (ShadowKV's own
    decoder, a working-set row) and a row on the device-pool tier: each still equals its lone self."""
    specs = [(p, {}) for p in PAGED] + [("shadowkv", {}), ("quest", {"offload": "pool"}),
                                        ("prkv", {"group_reduce": "softmax", "budget": 24})]
    lengths = [33 + 11 * i for i in range(len(specs))]
    tw = Twins(specs, lengths, seed=2)
    ws = tw.bat[0]  # a row attending over an in-place working set runs alone in both
    ws.working_set = tw.ref[0].working_set = True
    for dec in (tw.bat[0], tw.ref[0]):
        from kvstitch.decode.pool import WorkingSet

        dec.layers[0].ws = WorkingSet(dec.layers[0].host, dec.device)
    assert tw.run([5 + (i % 4) for i in range(len(specs))]) < 1e-5
    tw.check_stats()


def test_rows_copied_on_several_threads_equal_the_reference(path):
    """With several intra-op threads the rows' gathers (or the kernel's (row, KV head) pairs) are split over
    threads (tiny sizes: a correctness check, not a timing)."""
    have = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tw = Twins([("prkv", {}), ("quest", {"offload": "pool"}), ("quest", {})], [45, 60, 80], seed=5)
        assert tw.run([4, 4, 4]) < 1e-5
    finally:
        torch.set_num_threads(have)
    tw.check_stats()


@pytest.mark.skipif(not paged_kernel.available(), reason="numba (the kvstitch[fast] extra) not installed")
@pytest.mark.parametrize("policy,options", SPECS[:len(PAGED)] + [("prkv", {"digest": "moments", "rerank_interval": 2})])
def test_lone_attend_in_place_equals_the_gather_path(policy, options, monkeypatch):
    """A lone decoder (batch 1) reads its pages in place through the kernel on a CPU float32 pool
    (`paged_kernel.select_attend_row`: page table and attention in one call; `attend_row` after a torch ranking): per step and layer (a sliding-window layer among them, static refreshes, ragged lengths) the
    same pages and outputs within float rounding as gathering them with torch (the reference path)."""
    calls = {"attend_row": 0, "select_attend_row": 0}

    def counted(name):
        real = getattr(paged_kernel, name)

        def run(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return run

    for name in calls:
        monkeypatch.setattr(paged_kernel, name, counted(name))
    tw = Twins([(policy, options)] * 2, [41, 86], seed=7)
    err = 0.0
    for _ in range(8):
        for layer in range(2):
            for i in range(2):
                k, v, q = tw.randn(HKV, 1, D), tw.randn(HKV, 1, D), tw.randn(HQ, 1, D)
                for dec in (tw.ref[i], tw.bat[i]):
                    dec.append(layer, k, v)
                monkeypatch.setattr(kernel_common, "ENABLED", False)
                want = tw.ref[i].attend(layer, q, SCALE)
                monkeypatch.setattr(kernel_common, "ENABLED", True)
                got = tw.bat[i].attend(layer, q, SCALE)
                assert torch.equal(tw.ref[i].layers[layer].selected, tw.bat[i].layers[layer].selected)
                assert got.shape == want.shape == (HQ, 1, D) and got.dtype == want.dtype
                err = max(err, (got - want).abs().max().item())
        for dec in tw.ref + tw.bat:
            dec.end_step()
    # every attend ran a kernel; the page table and attention in one call unless the ranking has no kernel form
    assert err < 1e-5 and sum(calls.values()) == 8 * 2 * 2
    if rank_kernel.rank_ok(tw.bat[0].policy, "cpu"):
        assert calls["select_attend_row"] == 8 * 2 * 2
    tw.check_stats()


def test_half_precision_pools_take_the_torch_path(monkeypatch):
    """bfloat16 pools: numba has no bfloat16, so the batched step gathers with torch (the kernel never runs);
    the rows still equal their lone attends."""
    def never(*a, **kw):
        raise AssertionError("the kernel ran on a bfloat16 pool")

    monkeypatch.setattr(paged_kernel, "paged_attention", never)
    tw = Twins([("prkv", {"dtype": torch.bfloat16}), ("quest", {"dtype": torch.bfloat16})], [45, 70], seed=6)
    assert tw.run([4, 5]) < 1e-5


def test_diagnostic_rows_record_the_same_recall(path):
    tw = Twins([("prkv", {}), ("quest", {}), ("dense", {})], [50, 70, 90], seed=3)
    for dec in tw.ref + tw.bat:
        dec.diagnostic = True
    tw.run([6, 6, 6])
    for ref, bat in zip(tw.ref, tw.bat):
        a, b = ref.recall.steps(), bat.recall.steps()
        assert a.shape == b.shape and a.numel() and torch.allclose(a, b, atol=1e-5)
    assert tw.bat[2].recall.mean() == pytest.approx(1.0)  # dense attends everything


def test_rank_pages_equals_box_scores_row_by_row():
    """The batched ranking of every bound policy / group rule: each row's scores are its `box_scores`,
    padded with -inf."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, HKV, HQ // HKV, D, generator=g)
    boxes = [torch.randn(HKV, c, 2 * D, generator=g).abs() for c in (5, 9, 7)]
    policies = [make_policy(p) for p in PAGED if p != "dense"] + [make_policy("quest", group_reduce=r) for r in GROUP_REDUCES]
    policies += [make_policy("arkvale", kv_head_groups=2)] + [make_policy(p, digest="moments", group_reduce=r)
                                                                for p in ("quest", "prkv") for r in GROUP_REDUCES]
    for pol in policies:
        got = pol.rank_pages(q, boxes, [1, 2, 3], SCALE)
        for i, box in enumerate(boxes):
            c = box.shape[1]
            assert torch.allclose(got[i, :, :c], pol.box_scores(q[i], box, i + 1, SCALE), atol=1e-6), pol
            assert torch.isinf(got[i, :, c:]).all()


@pytest.mark.skipif(not paged_kernel.available(), reason="numba (the kvstitch[fast] extra) not installed")
def test_numba_ranking_picks_what_box_scores_and_topk_pick():
    """`rank_kernel.top_pages` (a CPU step's ranking in one call) against the torch reference, for every digest
    and group rule: the same pages in the same order (random scores: no ties), candidates from page 3 on."""
    from kvstitch.decode.pool import PageBounds

    g = torch.Generator().manual_seed(9)
    for digest in ("box", "moments"):
        bounds = PageBounds(HKV, P, D, "cpu", digest)
        bounds.rebuild(torch.randn(HKV, 23 * P + 2, D, generator=g) * 2)  # 24 pages, the last partial
        q = torch.randn(HKV, HQ // HKV, D, generator=g)
        for reduce in GROUP_REDUCES:
            pol = make_policy("quest", group_reduce=reduce, digest=digest)
            assert rank_kernel.rank_ok(pol, "cpu")
            want = pol.box_scores(q, bounds.digests(3, 21), 3, SCALE).topk(7, dim=1).indices + 3
            got = rank_kernel.top_pages(pol, q, bounds, 3, 21, 7, SCALE)
            assert torch.equal(got, want), (digest, reduce)
    assert not rank_kernel.rank_ok(make_policy("arkvale"), "cpu")  # its shared groups rank with torch
    assert not rank_kernel.rank_ok(make_policy("snapkv"), "cpu")  # recency: nothing to score


# ---- GQA: one page choice per KV head for the query heads that share it ----------------------------------
def _gqa_case():
    """One KV head shared by two query heads that want different pages. Head A (large logits) puts nearly all
    its attention on page 0 (page 1 is its distant second); head B (small logits) spreads over pages 2 and 3.
    Per query head the best two pages are {0, 1} and {2, 3}: a per-KV-head choice must trade them off."""
    keys = torch.tensor([[8.0, 0]] * 4 + [[5.0, 0]] * 4 + [[0, 3.0]] * 4 + [[0, 2.9]] * 4 + [[0, 0]] * 4)
    q = torch.tensor([[[3.0, 0], [0, 1.0]]])  # [Hkv=1, G=2, D=2]
    return q, keys.unsqueeze(0), 4


def _choice_recall(group_reduce: str, pages: int = 2) -> float:
    q, keys, page = _gqa_case()
    scale = 2 ** -0.5
    paged = keys.view(1, -1, page, 2)
    box = torch.cat([paged.amax(2), -paged.amin(2)], dim=-1)  # PageBounds' (kmax | -kmin)
    scores = make_policy("quest", group_reduce=group_reduce).box_scores(q, box, 0, scale)  # [1, C]
    chosen = scores.topk(pages, dim=-1).indices  # [1, pages]
    tokens = (chosen.unsqueeze(-1) * page + torch.arange(page)).flatten(1)
    probs = (q @ keys.transpose(1, 2) * scale).softmax(-1)  # [1, G, n]: each query head's attention
    return attention_recall(probs, tokens, torch.ones_like(tokens, dtype=torch.bool)).mean().item()


def _per_query_head_recall(pages: int = 2) -> float:
    """The ceiling: each query head choosing its own pages (what a per-KV-head choice cannot do)."""
    q, keys, page = _gqa_case()
    probs = (q @ keys.transpose(1, 2) * 2 ** -0.5).softmax(-1)[0]  # [G, n]
    per_page = probs.view(2, -1, page).sum(-1)
    return per_page.topk(pages, dim=-1).values.sum(-1).mean().item()


def test_gqa_softmax_rule_covers_every_query_head():
    """Mean and max of the raw bounds follow head A's large logits (pages 0 and 1: head B gets almost nothing);
    normalising each head's scores first (softmax, PRKV's static-set rule) gives head B a page."""
    q, keys, page = _gqa_case()
    per_head = bound_scores(q, keys.view(1, -1, page, 2).amin(2), keys.view(1, -1, page, 2).amax(2))[0]
    assert set(per_head[0].topk(2).indices.tolist()) == {0, 1}  # the heads' own choices differ
    assert set(per_head[1].topk(2).indices.tolist()) == {2, 3}
    ceiling = _per_query_head_recall()
    mean, top, soft = _choice_recall("mean"), _choice_recall("max"), _choice_recall("softmax")
    assert mean < 0.6 and top < 0.6  # head A covered, head B not
    assert soft > 0.7 and soft > mean + 0.15 and soft > top + 0.15
    assert soft <= ceiling + 1e-6 and ceiling > 0.9


def test_group_reduce_is_checked():
    from kvstitch.core.errors import BadDecodeOption

    with pytest.raises(BadDecodeOption, match="softmax"):
        make_policy("prkv", group_reduce="median")


@pytest.mark.skipif(not paged_kernel.available(), reason="numba (the kvstitch[fast] extra) not installed")
def test_batched_append_writes_what_each_row_appending_alone_writes(monkeypatch):
    """`append_batch` (one kernel call for the rows) against each row's own `append`: pools, token positions
    and page digests (box and moments, a moments page settled as the next page starts) bit for bit, over page
    boundaries, a pool that has to grow, and a row (the device-pool tier) that appends on its own."""
    from kvstitch.decode.batched import append_batch

    calls = []
    real = append_kernel.append_rows
    monkeypatch.setattr(append_kernel, "append_rows", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    specs = [("prkv", {}), ("quest", {"digest": "moments"}), ("quest", {}), ("quest", {"offload": "pool"})]
    tw = Twins(specs, [30, 41, 4 * P * 2 - 3, 37], seed=3)
    for _ in range(2 * P + 3):
        for layer in range(2):
            k, v = tw.randn(len(specs), HKV, 1, D), tw.randn(len(specs), HKV, 1, D)
            for i, dec in enumerate(tw.ref):
                dec.append(layer, k[i], v[i])
            append_batch(tw.bat, layer, k, v)
        for dec in tw.ref + tw.bat:
            dec.end_step()
    assert calls == [3] * (2 * (2 * P + 3))  # the device-pool row appended on its own
    for ref, bat in zip(tw.ref, tw.bat):
        for a, b in zip(ref.layers, bat.layers):
            assert a.host.n_tokens == b.host.n_tokens
            assert torch.equal(a.host.data, b.host.data) and torch.equal(a.host.token_pos, b.host.token_pos)
            assert a.bounds._lagging == b.bounds._lagging and torch.equal(a.bounds.data, b.bounds.data)
            if a.bounds.sums is not None:
                assert torch.equal(a.bounds.sums, b.bounds.sums) and torch.equal(a.bounds.count, b.bounds.count)
