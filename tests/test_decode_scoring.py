"""Page bound, GQA observation scores, static permutation and online S (kvstitch.decode.page_scores / static)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstitch.decode.policies import ArkVale, Quest
from kvstitch.decode.page_scores import bound_scores, observation_probs, observation_scores
from kvstitch.decode.static import online_static_ratio, pool_in_token_order, static_permutation


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), page=st.integers(1, 9), dim=st.integers(1, 12), scale=st.floats(0.01, 100))
def test_quest_bound_is_an_upper_bound_of_every_qk_in_the_page(seed, page, dim, scale):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, page, dim, generator=g, dtype=torch.float64) * scale
    q = torch.randn(1, 1, dim, generator=g, dtype=torch.float64) * scale
    kmin, kmax = keys.amin(1, keepdim=True), keys.amax(1, keepdim=True)
    bound = bound_scores(q.double(), kmin, kmax).double()  # [1, 1, 1]
    direct = torch.maximum(q * kmin, q * kmax).sum(-1)     # Σ_d max(q_d kmin_d, q_d kmax_d)
    assert torch.allclose(bound.view(-1), direct.view(-1), rtol=1e-5, atol=1e-5 * scale * scale)
    qk = (q @ keys.transpose(1, 2)).view(-1)
    assert (qk <= bound.view(-1) + 1e-5 * scale * scale * dim).all()
    if page == 1:  # a one-token page: the bound is tight
        assert torch.allclose(bound.view(-1), qk, rtol=1e-5, atol=1e-5 * scale * scale * dim)


def _direct_observation_scores(obs_q, keys, scaling):
    """Per query head: softmax(q K_{h//G}^T), causal among the last w; then mean over group and window."""
    Hq, w, _ = obs_q.shape
    Hkv, n, _ = keys.shape
    G = Hq // Hkv
    per_head = torch.zeros(Hq, n)
    for h in range(Hq):
        for i in range(w):
            visible = n - w + i + 1
            p = torch.softmax(keys[h // G, :visible] @ obs_q[h, i] * scaling, dim=0)
            per_head[h, :visible] += p / w
    return torch.stack([per_head[g * G : (g + 1) * G].mean(0) for g in range(Hkv)])


def test_gqa_observation_scores_match_direct_per_head_computation():
    torch.manual_seed(0)
    obs_q, keys = torch.randn(6, 5, 8), torch.randn(2, 30, 8)
    got = observation_scores(obs_q, keys, 0.3)
    assert torch.allclose(got, _direct_observation_scores(obs_q, keys, 0.3), atol=1e-6)
    # averaging the queries of a group first (what PRKV Sec. 4.1 warns against) is a different score
    q_avg = obs_q.view(2, 3, 5, 8).mean(1).repeat_interleave(3, 0)
    assert not torch.allclose(observation_scores(q_avg, keys, 0.3), got, atol=1e-3)
    probs = observation_probs(obs_q, keys, 0.3)
    assert torch.allclose(probs.sum(-1), torch.ones(6, 5)) and (probs[:, 0, -4:] == 0).all()  # causal


def test_static_permutation_puts_sinks_and_top_tokens_first_in_token_order():
    scores = torch.tensor([[0.0, 0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.0]])
    pos = torch.tensor([[0, 1, 7, 2, 6, 3, 5, 4]])  # a previously restructured storage order
    perm = static_permutation(scores, pos, n_static=4, n_sinks=1)
    new_pos = pos.gather(1, perm)
    assert sorted(perm[0].tolist()) == list(range(8))
    assert new_pos[0, :4].tolist() == [0, 5, 6, 7]  # sink (pos 0) + top 3 (0.9, 0.8, 0.7) in token order
    assert new_pos[0, 4:].tolist() == [1, 2, 3, 4]  # the rest keep token order


def test_pooling_runs_in_token_order():
    scores = torch.rand(2, 12)
    ident = torch.arange(12).expand(2, -1)
    expected = F.avg_pool1d(scores.unsqueeze(1), 5, 1, 2, count_include_pad=False).squeeze(1)
    assert torch.allclose(pool_in_token_order(scores, ident, 5), expected)
    shuffle = torch.randperm(12).expand(2, -1)  # storage j holds token shuffle[j]
    in_token_order = torch.empty_like(scores).scatter_(1, shuffle, scores)
    pooled = pool_in_token_order(scores, shuffle, 5)
    assert torch.allclose(pooled, pool_in_token_order(in_token_order, ident, 5).gather(1, shuffle))


def test_online_static_ratio_follows_app_g():
    torch.manual_seed(1)
    probs = torch.rand(4, 3, 200).softmax(-1)
    k, P = 64, 8
    overlaps = [len(set(probs[h, 0].topk(k).indices.tolist()) & set(probs[h, -1].topk(k).indices.tolist()))
                for h in range(4)]
    assert online_static_ratio(probs, k, P) == P * math.floor(sum(overlaps) / 4 / P) / k
    same = probs.clone()
    same[:, -1] = same[:, 0]  # first and last observation queries agree: S = 1 (k is a page multiple)
    assert online_static_ratio(same, k, P) == 1.0
    assert online_static_ratio(same, 60, P) == 56 / 60  # rounded down to whole pages


def test_group_reduction_of_page_scores():
    torch.manual_seed(2)
    q, kmin = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    kmax = kmin + torch.rand(2, 5, 8)
    per_head = bound_scores(q, kmin, kmax)
    assert torch.allclose(Quest().page_scores(q, kmin, kmax, 0), per_head.amax(1))
    shared = ArkVale().page_scores(q, kmin, kmax, 0)  # one choice for all KV heads
    assert torch.allclose(shared[0], per_head.sum((0, 1))) and torch.equal(shared[0], shared[1])


# ---- the moments digest and the shared (per-KV-head) oracle ------------------------------------------------
def _digests(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(box, moments) digests of ``keys [1, n, D]`` as `PageBounds` keeps them."""
    from kvstitch.decode.pool import PageBounds

    out = []
    for kind in ("box", "moments"):
        b = PageBounds(1, page, keys.shape[-1], "cpu", digest=kind)
        b.rebuild(keys)
        out.append(b.digests(0, keys.shape[1] // page))
    return out[0], out[1]


def test_moments_rank_a_page_of_high_keys_above_a_wide_box():
    """Page 0 holds four keys each large in one dimension (q·k = 4, but its box spans 4 in every dimension:
    bound 16); page 1 holds four keys of q·k = 10. Page 1 has nearly all the attention: the box bound ranks page
    0 first, the moments estimate page 1."""
    from kvstitch.decode.policies import make_policy

    q = torch.ones(1, 1, 4)
    keys = torch.cat([4 * torch.eye(4), torch.full((4, 4), 2.5)]).unsqueeze(0)
    box, moments = _digests(keys, 4)
    by_box = make_policy("quest").box_scores(q, box, 0, 0.5)
    by_moments = make_policy("quest", digest="moments").box_scores(q, moments, 0, 0.5)
    mass = (q @ keys.transpose(1, 2) * 0.5).softmax(-1).view(2, 4).sum(-1)
    assert mass[1] > 0.9
    assert by_box[0, 0] > by_box[0, 1] and by_moments[0, 1] > by_moments[0, 0]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.05, 1.0))
def test_moments_score_is_the_page_log_mass_to_second_order(seed, scale):
    """Keys close to their mean (spread eps): q·μ + s/2·q²·σ² equals (1/s)·log mean_j exp(s·q·k_j) up to
    O(eps^3), while the box bound is off by O(eps)."""
    from kvstitch.decode.policies import make_policy

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 8, generator=g, dtype=torch.float64).float()
    eps = 0.05
    keys = (torch.randn(1, 8, generator=g) + eps * torch.randn(8, 8, generator=g)).unsqueeze(0)
    box, moments = _digests(keys, 8)
    exact = (torch.logsumexp(scale * (q @ keys.transpose(1, 2)), -1) - math.log(8)) / scale
    est = make_policy("quest", digest="moments").box_scores(q, moments, 0, scale)
    bound = make_policy("quest").box_scores(q, box, 0, scale)
    spread = (q.abs() @ (keys.amax(1) - keys.amin(1)).T).item()  # how loose the box can be
    assert abs(est.item() - exact.item()) < 0.02 * spread + 1e-4
    assert bound.item() >= exact.item() - 1e-5


def test_shared_oracle_is_the_best_selection_a_kv_group_can_share():
    """Brute force over every k-token set of one KV head with 3 query heads: the shared oracle is the best mean
    recall; it lies between any shared selection's recall and the per-query-head oracle."""
    import itertools

    from kvstitch.decode.recall import attention_recall, oracle_recall

    g = torch.Generator().manual_seed(7)
    probs = (3 * torch.randn(1, 3, 7, generator=g)).softmax(-1)
    k = 3
    best = max(attention_recall(probs, torch.tensor([c]), torch.ones(1, k, dtype=torch.bool)).mean().item()
               for c in itertools.combinations(range(7), k))
    shared = oracle_recall(probs, k, shared=True)
    assert shared.mean().item() == pytest.approx(best, abs=1e-6)
    assert (shared <= oracle_recall(probs, k) + 1e-6).all()
    assert shared.mean() < oracle_recall(probs, k).mean()  # the heads want different tokens here
