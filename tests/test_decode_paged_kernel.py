"""The CPU paged sparse-attention kernel (`decode.paged_kernel`, numba) against a plain torch formula, and a
batched decode through it against the torch path (`decode.batched`, kernel switched off)."""

import pytest
import torch

from kvstitch.core.errors import InputError
from kvstitch.decode import kernel_common, paged_kernel, rank_kernel

from .test_batched_sparse import _request, drive
from .conftest import make_tiny_engine

pytestmark = pytest.mark.skipif(not paged_kernel.available(), reason="numba (the kvstitch[fast] extra) not installed")

P, D = 4, 12  # D not a multiple of a vector width: the loops' tails run too


def _reference(q, pools, slots, pages, counts, n_tokens, lo, scaling):
    """Row by row and KV head: softmax over the listed pages' attended tokens, in float64."""
    B, Hq, _ = q.shape
    H = pools[0].shape[1]
    G = Hq // H
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            n = int(counts[b])
            if n == 0:
                continue
            blocks = pools[b][slots[b, h, :n], h].double()  # [n, 2, P, D]
            tok = (pages[b, h, :n].unsqueeze(1) * P + torch.arange(P)).flatten()
            keep = (tok < n_tokens[b]) & (tok >= lo[b])
            k, v = blocks[:, 0].reshape(-1, D)[keep], blocks[:, 1].reshape(-1, D)[keep]
            if k.shape[0]:
                probs = (q[b, h * G:(h + 1) * G].double() @ k.T * scaling).softmax(-1)
                out[b, h * G:(h + 1) * G] = probs @ v
    return out.float()


def _case(Hq: int, H: int, seed: int = 0):
    """Five ragged rows, each with its own pool: different page counts (one empty), a partial last page, a
    sliding window (``lo`` > 0), a pool filled to its last page, and one row read through permuted slots (the
    device-pool tier: masks follow the storage page, reads the slot); pad entries point at live pages."""
    g = torch.Generator().manual_seed(seed)
    n_tokens = [37, 50, 23, 64, 41]
    lo = [0, 0, 0, 22, 0]
    capacity = [12, 14, 8, 16, 11]  # row 3: n_tokens fills its 16 pages exactly
    counts = [5, 9, 0, 11, 7]
    M = max(counts) + 2
    pools = [torch.randn(c, H, 2, P, D, generator=g) * 2 for c in capacity]
    pages = torch.zeros(len(n_tokens), H, M, dtype=torch.long)
    for b, (n, m) in enumerate(zip(n_tokens, counts)):
        last = -(-n // P) - 1
        for h in range(H):  # distinct pages per head, the last (partial or pool-ending) page among them
            pick = torch.randperm(last, generator=g)[: max(0, m - 1)].tolist() + [last]
            pages[b, h, :m] = torch.tensor(pick[-m:] if m else [], dtype=torch.long)
            pages[b, h, m:] = torch.randint(0, last + 1, (M - m,), generator=g)
    slots = pages.clone()
    perm = torch.randperm(capacity[4], generator=g)  # row 4: block s of its pool holds storage page perm[s]
    host = pools[4]
    pools[4] = torch.empty_like(host)
    pools[4][perm] = host  # storage page p now sits at slot perm[p]
    slots[4] = perm[pages[4]]
    q = torch.randn(len(n_tokens), Hq, D, generator=g)
    as_t = lambda x: torch.tensor(x)  # noqa: E731
    return q, pools, slots, pages, as_t(counts), as_t(n_tokens), as_t(lo), host


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("Hq,H", [(6, 2), (4, 4), (8, 1)])
def test_kernel_equals_reference(Hq, H, threads):
    q, pools, slots, pages, counts, n_tokens, lo, host = _case(Hq, H)
    have = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_kernel.paged_attention(q, pools, slots, pages, counts, n_tokens, lo, 0.3)
    finally:
        torch.set_num_threads(have)
    ref_pools = pools[:4] + [host]  # the reference reads row 4's storage pages directly
    want = _reference(q, ref_pools, pages, pages, counts, n_tokens, lo, 0.3)
    assert got.shape == (5, Hq, D) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5
    assert torch.equal(got[2], torch.zeros(Hq, D))  # no pages: zeros (the other rows are checked above)


@pytest.mark.parametrize("Hq,H", [(6, 2), (9, 3), (8, 1)])
def test_one_row_equals_reference(Hq, H):
    """`attend_row` (a lone decoder's step) over one pool: a partial last page, a sliding window."""
    q, pools, slots, pages, counts, n_tokens, lo, _ = _case(Hq, H, seed=3)
    for b in (1, 3):  # a partial last page; a sliding window (lo > 0)
        m = int(counts[b])
        got = paged_kernel.attend_row(q[b].unsqueeze(1), pools[b], pages[b, :, :m], int(n_tokens[b]), int(lo[b]),
                                      0.3)
        want = _reference(q[b:b + 1], pools[b:b + 1], pages[b:b + 1], pages[b:b + 1], counts[b:b + 1],
                          n_tokens[b:b + 1], lo[b:b + 1], 0.3)
        assert got.shape == (Hq, 1, D) and (got[:, 0] - want[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("digest,reduce", [("box", "max"), ("box", "mean"), ("moments", "softmax")])
def test_select_attend_row_is_the_separate_ranking_and_attention_in_one_call(digest, reduce):
    """`select_attend_row` (a lone step's page table and attention in one call) builds the table `_select_pages`
    builds - front pages, `top_pages`' picks best first, local pages - or takes a remembered ranking, and attends
    over it as `attend_row` does."""
    from kvstitch.decode.plan import plan_step
    from kvstitch.decode.policies import make_policy
    from kvstitch.decode.pool import PageBounds

    Hq, H, D, P, n = 6, 2, 16, 4, 57
    gen = torch.Generator().manual_seed(11)
    pool = torch.randn(16, H, 2, P, D, generator=gen)
    keys = pool[:, :, 0].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]
    bounds = PageBounds(H, P, D, "cpu", digest=digest)
    bounds.rebuild(keys)
    policy = make_policy("quest", digest=digest, group_reduce=reduce)
    q = torch.randn(Hq, 1, D, generator=gen)
    plan = plan_step(n, P, 24, 1, 8)  # 1 front page, a few dynamic ones of the candidates, the local pages
    assert 0 < plan.n_dynamic < plan.n_candidates
    table, ranked, out = paged_kernel.select_attend_row(q, pool, bounds, plan, policy, None, 0.3)
    picked = rank_kernel.top_pages(policy, q.view(H, -1, D), bounds, plan.front, plan.local_start, plan.n_dynamic,
                                    0.3)
    front = torch.arange(plan.front).expand(H, -1)
    local = torch.arange(plan.local_start, plan.n_pages).expand(H, -1)
    assert torch.equal(ranked, picked) and torch.equal(table, torch.cat([front, picked, local], dim=1))
    want = paged_kernel.attend_row(q, pool, table, n, 0, 0.3)
    assert (out - want).abs().max().item() < 1e-6
    # a ranking kept from an earlier step: the last candidates, latest first
    remembered = torch.arange(plan.local_start - 1, plan.local_start - 1 - plan.n_dynamic, -1).expand(H, -1).contiguous()
    table, ranked, out = paged_kernel.select_attend_row(q, pool, bounds, plan, policy, remembered, 0.3)
    assert ranked is None and torch.equal(table[:, plan.front:plan.front + plan.n_dynamic], remembered)
    assert (out - paged_kernel.attend_row(q, pool, table, n, 0, 0.3)).abs().max().item() < 1e-6
    with pytest.raises(InputError, match="the pool holds"):
        paged_kernel.select_attend_row(q, pool[:10], bounds, plan, policy, None, 0.3)


def test_kernel_rejects_what_it_cannot_read():
    q, pools, slots, pages, counts, n_tokens, lo, _ = _case(6, 2)
    bad = slots.clone()
    bad[1, 0, 0] = pools[1].shape[0]  # one past the pool's end
    with pytest.raises(InputError, match="outside its pool"):
        paged_kernel.paged_attention(q, pools, bad, pages, counts, n_tokens, lo, 0.3)
    half = [p.to(torch.bfloat16) for p in pools]
    with pytest.raises(InputError, match="float32"):
        paged_kernel.paged_attention(q, half, slots, pages, counts, n_tokens, lo, 0.3)
    assert not paged_kernel.kernel_ok(torch.bfloat16, "cpu") and not paged_kernel.kernel_ok(torch.float32, "cuda")
    assert paged_kernel.kernel_ok(torch.float32, "cpu")


# ---- engine level: a batched decode through the kernel == through the torch path -------------------------
def _run(engine, requests, kernel: bool, monkeypatch):
    """Decode the requests together (`drive`) -> (their tokens, every decode_batch's logits, kernel calls)."""
    calls, logits = [0], []
    real_decode = engine.decode_batch

    def counted(real):
        def run(*a, **kw):
            calls[0] += 1
            return real(*a, **kw)
        return run

    def recorded(steps, *a, **kw):
        out = real_decode(steps, *a, **kw)
        logits.append([lg.detach().clone() for lg in out])
        return out

    with monkeypatch.context() as m:
        m.setattr(kernel_common, "ENABLED", kernel)
        for name in ("paged_attention", "select_attend_rows"):  # tables built apart, or in the kernel call
            m.setattr(paged_kernel, name, counted(getattr(paged_kernel, name)))
        m.setattr(engine, "decode_batch", recorded)
        _, tokens, _ = drive(engine, requests)
    return tokens, logits, calls[0]


def test_batched_decode_through_the_kernel_matches_the_torch_path(smollm_tokenizer, monkeypatch):
    """Three ragged PRKV / Quest requests decoded together on a tiny model: each step's logits through the
    kernel are within float tolerance of the torch path's. Greedy tokens follow; a token may differ only at a
    near tie of the two paths' top logits (then the runs part and the comparison ends there)."""
    engine = make_tiny_engine("llama", smollm_tokenizer)
    reqs = [_request(0, "prkv", 12), _request(1, "quest", 8), _request(2, "prkv", 10)]
    tok_k, lg_k, calls_k = _run(engine, reqs, True, monkeypatch)
    tok_t, lg_t, calls_t = _run(engine, reqs, False, monkeypatch)
    assert calls_k > 0 and calls_t == 0  # the kernel ran in the first decode only
    compared = 0
    for step_k, step_t in zip(lg_k, lg_t):
        assert len(step_k) == len(step_t)
        for a, b in zip(step_k, step_t):
            a, b = a.float().flatten(), b.float().flatten()
            assert (a - b).abs().max().item() < 1e-4
            compared += 1
            if a.argmax() != b.argmax():
                top2 = b.topk(2).values
                assert (top2[0] - top2[1]).item() < 2e-4  # a near tie
                return
    assert tok_k == tok_t and compared > 10  # no near tie met: every step compared
