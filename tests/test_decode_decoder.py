"""SparseDecoder end to end: dense equivalence, static restructuring, refresh, recall, errors."""

import pytest
import torch

from kvstitch.decode import DECODE_POLICIES, decode_step_attention_recall, make_decoder
from kvstitch.decode.pool import K, V
from kvstitch.decode.page_scores import observation_scores
from kvstitch.core.errors import InputError

HQ, HKV, D, P = 6, 2, 8, 4
SCALE = D ** -0.5
STATIC_OPTS = {"prkv": dict(refresh_interval=3), "snapkv": dict(refresh_interval=3)}


def dense(q, keys, values, lo=0):
    """Reference: every query head h over all keys of KV head h // G from token `lo` on."""
    G = HQ // HKV
    k, v = keys[:, lo:].repeat_interleave(G, 0), values[:, lo:].repeat_interleave(G, 0)
    return torch.softmax(q @ k.transpose(1, 2) * SCALE, dim=-1) @ v


class Stream:
    """Random prefill + decode inputs for `layers` layers, kept in token order for the reference."""

    def __init__(self, n=60, layers=2, w=4, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.kv = [[self.randn(HKV, n, D), self.randn(HKV, n, D)] for _ in range(layers)]
        self.obs = [self.randn(HQ, w, D) for _ in range(layers)]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def prefill(self, dec, sliding=None):
        for layer, (k, v) in enumerate(self.kv):
            dec.load_prefill(layer, k, v, self.obs[layer], sliding_window=(sliding or {}).get(layer))

    def step(self, dec, check=None):
        """One decode step over every layer; `check(layer, q, out)` sees each output."""
        for layer, kv in enumerate(self.kv):
            k, v, q = self.randn(HKV, 1, D), self.randn(HKV, 1, D), self.randn(HQ, 1, D)
            kv[0], kv[1] = torch.cat([kv[0], k], 1), torch.cat([kv[1], v], 1)
            dec.append(layer, k, v)
            out = dec.attend(layer, q, SCALE)
            if check:
                check(layer, q, out)
        dec.end_step()


def decoder(policy, budget, layers=2, **kw):
    opts = {**STATIC_OPTS.get(policy, {}), "sinks": 2, "window": 6, **kw}
    if policy == "arkvale":
        opts.pop("sinks")
    return make_decoder(policy, budget, num_layers=layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                        page_size=P, **opts)


PAGED = sorted(set(DECODE_POLICIES) - {"shadowkv"})  # shadowkv: tests/test_decode_shadowkv.py


def test_registry_has_the_six_policies():
    assert set(DECODE_POLICIES) == {"dense", "snapkv", "quest", "arkvale", "prkv", "shadowkv"}


@pytest.mark.parametrize("policy", PAGED)
def test_budget_covering_the_context_reproduces_dense_decode(policy):
    """Budget >= final context: every step equals dense attention (layer 1 is a sliding-window layer and
    must equal dense attention over its window). Refreshes every 3 steps restructure the cache meanwhile."""
    s, steps, window = Stream(n=61), 10, 13
    dec = decoder(policy, budget=61 + steps)
    s.prefill(dec, sliding={1: window})
    dec.diagnostic = True

    def check(layer, q, out):
        keys, values = s.kv[layer]
        lo = keys.shape[1] - window if layer == 1 else 0
        assert torch.allclose(out, dense(q, keys, values, lo), atol=1e-5, rtol=0)

    for _ in range(steps):
        s.step(dec, check)
    recall = decode_step_attention_recall(dec)
    assert recall.shape == (steps, 2, HQ) and torch.allclose(recall, torch.ones_like(recall), atol=1e-5)
    if policy in STATIC_OPTS:
        assert dec.layers[0].static_steps == [0, 3, 6, 9] and dec.layers[1].static_steps == []


@pytest.mark.parametrize("policy", ["snapkv", "quest", "arkvale", "prkv"])
def test_small_budget_attends_exactly_the_selected_tokens_and_records_their_recall(policy):
    s = Stream(n=120, layers=1, seed=3)
    dec = decoder(policy, budget=32, layers=1)
    s.prefill(dec)
    dec.diagnostic = True
    recalls, counts = [], []

    def check(layer, q, out):
        st = dec.layers[0]
        stored_k, stored_v = st.host.rows(K), st.host.rows(V)
        n = stored_k.shape[1]
        tokens = (st.selected.unsqueeze(-1) * P + torch.arange(P)).flatten(1)
        tokens = [t[t < n] for t in tokens]
        counts.extend(len(t) for t in tokens)
        assert all(len(t) <= 32 + 6 for t in tokens)  # k = 32, the 6-token local window on top
        assert all(len(set(t.tolist())) == len(t) for t in tokens)
        G = HQ // HKV
        for h in range(HQ):
            idx = tokens[h // G]
            p = torch.softmax(stored_k[h // G, idx] @ q[h, 0] * SCALE, 0)
            assert torch.allclose(out[h, 0], p @ stored_v[h // G, idx], atol=1e-5)
            full = torch.softmax(stored_k[h // G] @ q[h, 0] * SCALE, 0)
            recalls.append(full[idx].sum().item())
        assert (n - 6) in tokens[0].tolist() and (n - 1) in tokens[1].tolist()  # local window

    for _ in range(7):
        s.step(dec, check)
    got = decode_step_attention_recall(dec).flatten()
    assert torch.allclose(got, torch.tensor(recalls), atol=1e-5)
    assert 0 < got.min() and got.max() < 1  # a real selection: some mass is missed
    assert dec.stats()["mean_selected_tokens"] == pytest.approx(sum(counts) / len(counts))


def test_static_restructure_preserves_kv_and_fronts_the_top_tokens():
    s = Stream(n=64, layers=1, seed=5)
    dec = decoder("prkv", budget=32, layers=1, static_ratio=0.5)
    s.prefill(dec)
    st, (keys, values) = dec.layers[0], s.kv[0]
    pos = st.host.token_pos[:, :64]
    for h in range(HKV):
        assert sorted(pos[h].tolist()) == list(range(64))
        assert torch.equal(st.host.rows(K)[h], keys[h, pos[h]]) and torch.equal(st.host.rows(V)[h], values[h, pos[h]])
        for stored, original in ((st.host.rows(K)[h], keys[h]), (st.host.rows(V)[h], values[h])):
            assert torch.equal(stored.flatten().sort().values, original.flatten().sort().values)  # multiset
    assert pos[0].tolist() != list(range(64))  # it did move tokens
    # front = 0.5 * 32 = 16 tokens (4 pages): the 2 sinks + the 14 best tokens of [0, R), R = 56
    assert st.front == 4
    scores = observation_scores(s.obs[0], keys, SCALE)[:, :56]
    for h in range(HKV):
        top = scores[h, 2:].topk(14).indices + 2
        assert sorted(pos[h, :16].tolist()) == [0, 1] + sorted(top.tolist())
        assert pos[h, 16:56].tolist() == sorted(set(range(56)) - set(pos[h, :16].tolist()))  # rest in order
        assert pos[h, 56:].tolist() == list(range(56, 64))  # the local window never moves


@pytest.mark.parametrize("policy", ["prkv", "snapkv"])
def test_static_set_is_refreshed_exactly_every_T_steps(policy):
    s = Stream(n=80, layers=2, seed=7)
    dec = decoder(policy, budget=40, refresh_interval=4)
    s.prefill(dec)
    fronts = []
    for _ in range(14):
        s.step(dec)
        fronts.append(dec.layers[0].host.token_pos[:, :16].clone())
    assert [st.static_steps for st in dec.layers] == [[0, 4, 8, 12]] * 2
    assert dec.stats()["static_refreshes"] == 6
    # between refreshes the static set does not move; it is re-chosen from the decode queries at step 4
    assert all(torch.equal(fronts[i], fronts[0]) for i in range(4))
    assert not torch.equal(fronts[4], fronts[3])


def test_online_static_ratio_is_chosen_per_layer_in_whole_pages():
    s = Stream(n=200, layers=2, seed=9)
    dec = decoder("prkv", budget=64, static_ratio="auto")
    s.prefill(dec)
    for ratio, st in zip(dec.static_ratios(), dec.layers):
        assert 0 <= ratio <= 1 and (ratio * 64) % P == 0
        assert st.front == max(1, min(int(ratio * 64) // P, (64 + 6) // P - 3))


def test_arkvale_heads_share_pages_quest_heads_choose_their_own():
    s = Stream(n=200, layers=1, seed=11)
    ark, quest = decoder("arkvale", 48, layers=1), decoder("quest", 48, layers=1)
    s.prefill(ark), s.prefill(quest)
    q = s.randn(HQ, 1, D)
    for dec in (ark, quest):
        dec.append(0, s.kv[0][0][:, -1:], s.kv[0][1][:, -1:])
        dec.attend(0, q, SCALE)
    assert torch.equal(ark.layers[0].selected[0].sort().values, ark.layers[0].selected[1].sort().values)
    assert not torch.equal(quest.layers[0].selected[0].sort().values, quest.layers[0].selected[1].sort().values)
    assert ark.layers[0].selected[0, :1].tolist() == [0]  # the sink page


def test_invalid_configurations_raise_input_errors():
    with pytest.raises(InputError, match="unknown decode policy"):
        decoder("h2o", 64)
    with pytest.raises(InputError, match="smaller than the sink"):
        decoder("quest", 8)
    with pytest.raises(InputError, match="static_ratio"):
        decoder("prkv", 64, static_ratio=1.5)
    with pytest.raises(InputError, match="bad options"):
        decoder("quest", 64, static_ratio=0.5)
    dec = decoder("prkv", 64)
    with pytest.raises(InputError, match="observation-window queries"):
        dec.load_prefill(0, torch.randn(HKV, 20, D), torch.randn(HKV, 20, D))
    with pytest.raises(InputError, match="no prefill"):
        dec.attend(1, torch.randn(HQ, 1, D), SCALE)


@pytest.mark.parametrize("policy", ["snapkv", "prkv"])
def test_prompt_shorter_than_the_window_still_keeps_the_sink_page(policy):
    """Nothing to restructure at prefill (all in the local window); the sink page must stay selected while
    decoding pushes the first tokens out of the window, until the refresh restructures the cache."""
    s = Stream(n=5, layers=1, seed=13)
    dec = decoder(policy, budget=24, layers=1, refresh_interval=20)
    s.prefill(dec)
    for _ in range(19):
        s.step(dec)
        assert (dec.layers[0].selected[:, 0] == 0).all()
    assert dec.layers[0].front == 1 and dec.layers[0].static_steps == [0]


def test_attend_rows_in_parallel_equals_each_decoder_alone():
    """A batched step's sparse rows run on several threads (`attend_rows`); each row's output is bit-identical
    to its decoder's lone attend, for mixed policies, over several steps (static refreshes included), and the
    caller's thread count is restored."""
    from kvstitch.decode.decoder import attend_rows

    policies = ["prkv", "quest", "snapkv", "arkvale", "prkv"]  # shadowkv: tests/test_batched_sparse.py
    kw = dict(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P, sinks=2, window=4)

    def build():
        decs = []
        for i, p in enumerate(policies):
            dec = make_decoder(p, 24, **kw, **STATIC_OPTS.get(p, {}))
            Stream(n=50 + 7 * i, seed=i).prefill(dec)
            decs.append(dec)
        return decs

    par, alone = build(), build()
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(5):
            for layer in range(2):
                kv = [(torch.randn(HKV, 1, D, generator=g), torch.randn(HKV, 1, D, generator=g)) for _ in policies]
                qs = [torch.randn(HQ, 1, D, generator=g) for _ in policies]
                for decs in (par, alone):
                    for d, (k, v) in zip(decs, kv):
                        d.append(layer, k, v)
                got = attend_rows(par, layer, qs, SCALE)
                assert torch.get_num_threads() == 2
                for d, q, out in zip(alone, qs, got):
                    assert torch.equal(out, d.attend(layer, q, SCALE))
            for d in par + alone:
                d.end_step()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("policy", ["quest", "prkv"])
def test_rerank_interval_ranks_every_r_steps_and_reuses_the_pages_between(policy, monkeypatch):
    """With ``rerank_interval=3`` the candidate digests are scored on 1 step in 3 (or again when the page count
    moved); in between a step attends the last ranking's dynamic pages. With 1, every step ranks and picks the
    default's pages."""
    from kvstitch.decode import paged_kernel, rank_kernel
    from kvstitch.decode.policies import BoundPolicy

    calls = []  # a ranking: torch's box_scores, the CPU's numba call, or the lone kernel step that ranked
    for owner, name in ((BoundPolicy, "box_scores"), (rank_kernel, "top_pages")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    fused = paged_kernel.select_attend_row

    def select_attend_row(*a, **k):
        table, ranked, out = fused(*a, **k)
        if ranked is not None:
            calls.append(1)
        return table, ranked, out

    monkeypatch.setattr(paged_kernel, "select_attend_row", select_attend_row)

    def run(**kw):
        opts = {"refresh_interval": 100} if policy == "prkv" else {}  # no static refresh during the test
        s, dec = Stream(n=60, layers=1, seed=5), decoder(policy, 16, layers=1, **opts, **kw)
        s.prefill(dec)
        calls.clear()
        tables, rankings = [], []
        for _ in range(9):
            s.step(dec)
            st = dec.layers[0]
            tables.append(st.selected.clone())
            rankings.append(st.ranked)
            if st.ranked is not None:  # the step attends the remembered ranking's pages, after the front
                front, n_dyn, pages = st.ranked[1:]
                assert torch.equal(st.selected[:, front: front + n_dyn], pages)
        return len(calls), tables, rankings

    ranks_default, default, _ = run()
    ranks1, every, none = run(rerank_interval=1)
    ranks3, sparse, kept = run(rerank_interval=3)
    assert ranks_default == ranks1 == 9 and all(torch.equal(a, b) for a, b in zip(default, every))
    assert none == [None] * 9  # nothing remembered when every step ranks
    assert 3 <= ranks3 <= 5  # steps 0, 3, 6, and any step whose page count moved
    reused = sum(a is b for a, b in zip(kept[:-1], kept[1:]))
    assert reused == 9 - ranks3 >= 4  # every step either ranks or attends the last ranking's pages
    assert all(k[0] <= t < k[0] + 3 for t, k in enumerate(kept))  # a ranking serves its own step and 2 more at most
    assert any(not torch.equal(a, b) for a, b in zip(sparse, default))  # reuse really changed some step
