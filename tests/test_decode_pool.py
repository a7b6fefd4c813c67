"""Paged pools, page bounds and the batched transfer (kvstitch.decode.pool / transfer)."""

import pytest
import torch

from kvstitch.decode import make_decoder
from kvstitch.decode.pool import K, V, DevicePool, HostPool, PageBounds
from kvstitch.decode.transfer import BatchedTransfer

HQ, HKV, D, P = 4, 2, 8, 4


def _direct_bounds(keys: torch.Tensor, page_size: int):
    """min / max over each page's filled keys, computed directly: [pages, Hkv, D] each."""
    n = keys.shape[1]
    chunks = [keys[:, a : a + page_size] for a in range(0, n, page_size)]
    return torch.stack([c.amin(1) for c in chunks]), torch.stack([c.amax(1) for c in chunks])


def _drive(dec, steps, seed=0, n=40, w=4, layers=1):
    """Prefill + `steps` decode steps of random data; returns the token-order K/V per layer."""
    g = torch.Generator().manual_seed(seed)
    kv = []
    for layer in range(layers):
        keys, values = torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)
        dec.load_prefill(layer, keys, values, torch.randn(HQ, w, D, generator=g))
        kv.append([keys, values])
    for _ in range(steps):
        for layer in range(layers):
            k, v, q = (torch.randn(HKV, 1, D, generator=g), torch.randn(HKV, 1, D, generator=g),
                       torch.randn(HQ, 1, D, generator=g))
            dec.append(layer, k, v)
            dec.attend(layer, q, D ** -0.5)
            kv[layer] = [torch.cat([kv[layer][0], k], 1), torch.cat([kv[layer][1], v], 1)]
        dec.end_step()
    return kv


def test_host_pool_is_hnd_paged_and_grows():
    keys, values = torch.randn(HKV, 10, D), torch.randn(HKV, 10, D)
    host = HostPool(HKV, P, D, torch.float32, capacity_tokens=4)
    host.load(keys, values)
    assert host.data.shape[1:] == (HKV, 2, P, D) and host.n_pages == 3
    for t in range(10):
        page, off = divmod(t, P)
        assert torch.equal(host.data[page, :, K, off], keys[:, t])
        assert torch.equal(host.data[page, :, V, off], values[:, t])
    extra = torch.randn(HKV, 1, D)
    for _ in range(20):  # crosses several reallocations
        host.append(extra, -extra)
    assert torch.equal(host.rows(K)[:, :10], keys) and torch.equal(host.rows(V)[:, 10:], -extra.expand(-1, 20, -1))
    assert torch.equal(host.token_pos[:, :30], torch.arange(30).expand(HKV, -1))


def _digested(keys: torch.Tensor, digest: str) -> tuple[PageBounds, torch.Tensor]:
    """Digests of ``keys`` rebuilt, then 8 appended keys (filling the partial page, then opening two new ones)
    -> (bounds, every key)."""
    bounds = PageBounds(HKV, P, D, "cpu", digest=digest)
    bounds.rebuild(keys)
    for _ in range(8):
        k = torch.randn(HKV, 1, D)
        page, off = divmod(keys.shape[1], P)
        bounds.add_token(page, off, k)
        keys = torch.cat([keys, k], 1)
    return bounds, keys


def test_page_bounds_equal_direct_min_max_after_appends():
    bounds, keys = _digested(torch.randn(HKV, 9, D), "box")
    lo, hi = _direct_bounds(keys, P)
    kmin, kmax = bounds.pages(0, lo.shape[0])
    assert torch.equal(kmin.transpose(0, 1), lo) and torch.equal(kmax.transpose(0, 1), hi)


def test_page_moments_equal_direct_mean_and_variance_after_appends():
    bounds, keys = _digested(torch.randn(HKV, 9, D) * 3 + 1, "moments")
    for c in range(-(-keys.shape[1] // P)):
        page = keys[:, c * P:(c + 1) * P]
        got = bounds.digests(c, c + 1)[:, 0]
        assert torch.allclose(got[:, :D], page.mean(1), atol=1e-5)
        assert torch.allclose(got[:, D:], page.var(1, unbiased=False), atol=1e-4)
    with pytest.raises(ValueError):
        bounds.pages(0, 1)  # no boxes kept


def test_decoder_moments_match_storage_after_restructure_and_refresh():
    dec = make_decoder("prkv", 16, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P,
                       sinks=1, window=4, static_ratio=0.5, refresh_interval=5, offload="pool", digest="moments")
    _drive(dec, steps=11)
    st = dec.layers[0]
    stored = st.host.rows(K).float()
    n = stored.shape[1]
    for c in range(st.host.n_pages):
        page = stored[:, c * P:min(n, (c + 1) * P)]
        assert torch.allclose(st.bounds.digests(c, c + 1)[:, 0, :D], page.mean(1), atol=1e-5)


def test_decoder_bounds_match_storage_after_restructure_and_refresh():
    dec = make_decoder("prkv", 16, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P,
                       sinks=1, window=4, static_ratio=0.5, refresh_interval=5, offload="pool")
    _drive(dec, steps=11)
    st = dec.layers[0]
    assert st.static_steps == [0, 5, 10]
    stored = st.host.rows(K)
    lo, hi = _direct_bounds(stored, P)
    kmin, kmax = st.bounds.pages(0, st.host.n_pages)
    assert torch.equal(kmin.transpose(0, 1), lo) and torch.equal(kmax.transpose(0, 1), hi)


def test_batched_transfer_one_copy_counts_pages_and_bytes():
    host = torch.randn(5, HKV, 2, P, D)
    dev = torch.zeros(3, HKV, 2, P, D)
    t = BatchedTransfer("cpu")
    pages, heads, slots = torch.tensor([4, 0, 4]), torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1])
    t.fetch(host, pages, heads, dev, slots)
    assert (t.copies, t.pages, t.bytes) == (1, 3, 3 * 2 * P * D * 4)
    for p, h, s in zip(pages, heads, slots):
        assert torch.equal(dev[s, h], host[p, h])
    assert dev[2, 1].abs().sum() == 0  # untouched (slot, head) blocks stay as they were


def test_device_pool_fetch_hits_do_not_copy_and_lru_evicts_stalest():
    host = HostPool(HKV, P, D, torch.float32)
    host.load(torch.randn(HKV, 6 * P, D), torch.randn(HKV, 6 * P, D))
    pool, t = DevicePool(HKV, P, D, torch.float32, "cpu", slots=3), BatchedTransfer("cpu")
    pool.fetch(torch.tensor([[0, 1], [2, 3]]), host, t, clock=1)
    assert t.pages == 4
    pool.fetch(torch.tensor([[1, 0], [3, 2]]), host, t, clock=2)  # all resident: nothing moves
    assert (t.pages, t.copies) == (4, 1)
    pool.fetch(torch.tensor([[1, 4], [5, 3]]), host, t, clock=3)  # misses fill the free third slot
    pool.fetch(torch.tensor([[1, 5], [0, 5]]), host, t, clock=4)
    # last use before clock 4 -- head 0: p0@2, p1@3, p4@3 -> p5 evicts p0; head 1: p2@2, p3@3, p5@3 -> p0 evicts p2
    assert {(h, p) for h, p, _ in pool.resident()} == {(0, 1), (0, 4), (0, 5), (1, 0), (1, 3), (1, 5)}
    assert (t.pages, t.copies) == (8, 3)
    for h, p, s in pool.resident():
        assert torch.equal(pool.data[s, h], host.data[p, h])


def test_decode_moves_each_needed_page_once():
    """With room for every page on the device, each (page, head) crosses exactly once, in at most one
    bulk copy per attend; appends write through to resident pages so nothing goes stale."""
    dec = make_decoder("quest", 24, num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P,
                       sinks=2, window=4, device_pages=64, offload="pool")
    needed = [set(), set()]
    copies_before = 0
    orig_attend = dec.attend

    def attend(layer, q, scaling):
        nonlocal copies_before
        out = orig_attend(layer, q, scaling)
        sel = dec.layers[layer].selected
        needed[layer] |= {(h, p) for h in range(HKV) for p in sel[h].tolist()}
        assert dec.transfer.copies - copies_before <= 1
        copies_before = dec.transfer.copies
        return out

    dec.attend = attend
    _drive(dec, steps=20, layers=2)
    assert dec.transfer.pages == len(needed[0]) + len(needed[1])
    assert dec.stats()["pages_copied"] == dec.transfer.pages
    assert dec.transfer.copies <= 2 * 20
    for st in dec.layers:
        for h, p, s in st.device.resident():
            filled = min(P, st.host.n_tokens - p * P)
            assert torch.equal(st.device.data[s, h, :, :filled], st.host.data[p, h, :, :filled])


def test_small_device_pool_stays_coherent_through_evictions_and_restructures():
    dec = make_decoder("prkv", 16, num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P,
                       sinks=1, window=4, refresh_interval=3, device_pages=4, offload="pool")
    _drive(dec, steps=14)
    st = dec.layers[0]
    assert st.device.slots >= 4 and len(st.static_steps) == 5
    for h, p, s in st.device.resident():
        filled = min(P, st.host.n_tokens - p * P)
        assert torch.equal(st.device.data[s, h, :, :filled], st.host.data[p, h, :, :filled])
