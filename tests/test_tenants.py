"""Tenants: the store partitioned by API key (no cross-tenant hit, documents, the shared opt-in, config errors,
`store stats` by tenant), and today's keys when no tenant is configured."""

from __future__ import annotations

import time

import httpx
import pytest
from typer.testing import CliRunner

from kvstitch import Engine
from kvstitch.core.errors import InputError
from kvstitch.serve.security import SecurityConfig
from kvstitch.serve.server import create_app
from kvstitch.serve.tenants import parse_tenants
from kvstitch.serve.testing import ServerThread
from kvstitch.store import MemoryStore
from kvstitch.store.tenants import TenantRouter, tenant_key, tenant_scope

from .conftest import SAMPLE_CHUNKS, SAMPLE_QUESTION, chat_body

A, A2, B, PUB = "tenant-a-key-1", "tenant-a-key-2", "tenant-b-key-1", "public-ingest-key"
TENANTS = {"acme": {"keys": [A, A2]}, "globex": {"keys": B}}


def chat(docs=None, **extra):
    return chat_body(docs, 2, **extra)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def ask(c, key, docs=None, **extra):
    r = c.post("/v1/chat/completions", json=chat(docs, **extra), headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["kvstitch"]


def series(c, key, name):
    lines = [ln for ln in c.get("/metrics", headers=auth(key)).text.splitlines() if ln.startswith(name + " ")]
    assert len(lines) == 1, lines  # one series: the caller's own, never the server's beside it
    return float(lines[0].split()[-1])


def test_no_cross_tenant_hit_and_stats_show_only_own_hits(disk_engine):
    app = create_app(disk_engine, security=SecurityConfig(tenants=TENANTS))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        first = ask(c, A, SAMPLE_CHUNKS[:2])
        assert first["store_hits"] == 0
        assert ask(c, A2, SAMPLE_CHUNKS[:2])["store_hits"] == 3  # a group of keys is one tenant (+ its segment)
        other = ask(c, B, SAMPLE_CHUNKS[:2])
        assert other["store_hits"] == 0 and other["store_misses"] == first["store_misses"]  # a miss, like A's first
        assert series(c, B, "kvstitch_store_hits_total") == 0  # A's hits are not in B's stats
        assert series(c, B, "kvstitch_ttft_seconds_count") == 1
        assert series(c, A, "kvstitch_store_hits_total") == 3
        assert series(c, A, "kvstitch_ttft_seconds_count") == 2
        assert "kvstitch_request_duration_seconds" not in c.get("/metrics", headers=auth(B)).text
        assert ask(c, B, SAMPLE_CHUNKS[:2])["store_hits"] == 3  # B's own namespace works
    lay = disk_engine.layout(None, SAMPLE_CHUNKS[:2], chat()["messages"])
    plain = [disk_engine.chunk_key(lay.prefix_ids, ids) for ids in lay.chunk_ids]
    stored = set(disk_engine.store.inner.keys())
    assert not set(plain) & stored  # no entry under today's keys: every one is in a tenant's namespace
    assert {tenant_key(k, t) for k in plain for t in ("acme", "globex")} <= stored


def test_another_tenants_document_is_404(disk_engine):
    app = create_app(disk_engine, security=SecurityConfig(tenants=TENANTS))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[0]}, headers=auth(A))
        assert r.status_code == 200, r.text
        doc = r.json()["data"][0]["id"]
        assert c.get(f"/v1/documents/{doc}", headers=auth(B)).status_code == 404
        r = c.delete(f"/v1/documents/{doc}", headers=auth(B))
        assert r.status_code == 404 and r.json()["error"]["code"] == "document_not_found"
        assert c.get("/v1/documents", headers=auth(B)).json()["data"] == []
        r = c.post("/v1/chat/completions", json=chat(document_ids=[doc]), headers=auth(B))
        assert r.status_code == 404
        got = c.get(f"/v1/documents/{doc}", headers=auth(A2))  # the other key of A's group
        assert got.status_code == 200 and got.json()["cached"]
        assert [d["id"] for d in c.get("/v1/documents", headers=auth(A)).json()["data"]] == [doc]
        # B posting the same text gets the same id, a document of its own: deleting it leaves A's
        assert c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[0]}, headers=auth(B)).json()["data"][0]["id"] == doc
        assert c.delete(f"/v1/documents/{doc}", headers=auth(B)).status_code == 200
        assert c.get(f"/v1/documents/{doc}", headers=auth(A)).json()["cached"]
        assert c.delete(f"/v1/documents/{doc}", headers=auth(A)).status_code == 200
        assert c.get(f"/v1/documents/{doc}", headers=auth(A)).status_code == 404


def test_shared_tenant_is_read_by_all_written_by_its_keys(disk_engine):
    tenants = {**TENANTS, "public": {"keys": [PUB], "shared": True}}
    app = create_app(disk_engine, security=SecurityConfig(tenants=tenants))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[0]}, headers=auth(PUB))
        pub = r.json()["data"][0]["id"]
        for key in (A, B):
            assert c.get(f"/v1/documents/{pub}", headers=auth(key)).json()["cached"]
            assert pub in {d["id"] for d in c.get("/v1/documents", headers=auth(key)).json()["data"]}
            assert ask(c, key, document_ids=[pub])["store_hits"] == 1  # the public passage (not the segment)
        r = c.delete(f"/v1/documents/{pub}", headers=auth(A))
        assert r.status_code == 403 and r.json()["error"]["code"] == "document_read_only"
        # a tenant's own chats never write into the shared namespace
        ask(c, A, SAMPLE_CHUNKS[1:2])
        assert ask(c, PUB, SAMPLE_CHUNKS[1:2])["store_hits"] == 0
        assert ask(c, B, SAMPLE_CHUNKS[1:2])["store_misses"] == 0  # the shared one PUB just computed
        assert c.delete(f"/v1/documents/{pub}", headers=auth(PUB)).status_code == 200
        assert c.get(f"/v1/documents/{pub}", headers=auth(A)).status_code == 404


def test_cold_chunks_are_computed_in_their_tenants_namespace(tiny):
    eng = Engine(tiny.model, tiny.tokenizer, "tiny-llama", store=MemoryStore(storage_dtype="float32"),
                 check_rope=False, cold_path="full_prefill")
    app = create_app(eng, security=SecurityConfig(tenants=TENANTS))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        assert ask(c, A, SAMPLE_CHUNKS[2:4])["cold_path"] == "full_prefill"
        t0 = time.monotonic()
        while len(eng.deferred) and time.monotonic() - t0 < 60:  # computed while the worker idles
            time.sleep(0.05)
        time.sleep(0.2)
        assert ask(c, A, SAMPLE_CHUNKS[2:4])["cold_path"] == "stitched"
        assert ask(c, B, SAMPLE_CHUNKS[2:4])["cold_path"] == "full_prefill"


@pytest.mark.parametrize("spec, message", [
    ({"Bad Name": {"keys": [A]}}, "tenant name"),
    ({"acme": {"keys": [A]}, "globex": {"keys": [A]}}, "listed by two tenants"),
    ({"acme": {"keys": [A], "shared": True}, "globex": {"keys": [B], "shared": True}}, "two shared tenants"),
    ({"acme": {"keys": [A], "admin": True}}, "unknown field 'admin'"),
    ({"acme": {"keys": []}}, "'keys' must be"),
    ({"acme": [A]}, "must be a table"),
    ({"acme": {"keys": ["short"]}}, "at least 8 characters"),
    ('{"acme": ', "not valid JSON"),
    ("per-key", "pass --api-key"),
    ("no-such-tenants.toml", "config file not found"),
])
def test_malformed_tenants_are_one_clear_error(spec, message):
    with pytest.raises(InputError, match=message):
        SecurityConfig(tenants=spec)


def test_malformed_tenants_fail_serve_at_start(monkeypatch, tmp_path):
    from kvstitch.cli.main import app

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded with a malformed tenants config")
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: no_load()))
    monkeypatch.delenv("KVSTITCH_API_KEY", raising=False)
    cfg = tmp_path / "kvstitch.toml"
    cfg.write_text(f'port = 1\n[tenants.acme]\nkeys = ["{A}"]\n[tenants.globex]\nkeys = ["{A}"]\n')
    out = CliRunner().invoke(app, ["serve", "--config", str(cfg)])
    assert out.exit_code == 2, out.output
    assert "tenants: an API key is listed by two tenants" in out.output and "Traceback" not in out.output
    assert A not in out.output  # the keys are not printed with the configuration
    out = CliRunner().invoke(app, ["serve", "--tenants", "per-key"])
    assert out.exit_code == 2 and "tenants are told apart by API key" in out.output


def test_keys_map_to_tenants():
    t = parse_tenants({"acme": {"keys": [A, A2]}, "public": {"keys": PUB, "shared": True}}, (B,))
    assert t.of(A) == t.of(A2) == "acme" and t.of(PUB) == "public" and t.shared == "public"
    assert t.of(B).startswith("key-") and t.of(None) is None  # an --api-key key no table names: its own
    assert parse_tenants("per-key", (A, B)).names == sorted({parse_tenants("per-key", (A, B)).of(k) for k in (A, B)})
    assert parse_tenants(None, (A,)) is None
    sec = SecurityConfig(api_keys=(B,), tenants={"acme": {"keys": [A]}})
    assert sec.authorized(f"Bearer {A}") and sec.authorized(f"Bearer {B}") and not sec.authorized("Bearer nope-nope")


def test_no_tenant_is_todays_store_bit_for_bit(tiny):
    key = "ab" * 32
    assert tenant_key(key, None) == key
    assert tenant_key(key, "acme") != key and len(tenant_key(key, "acme")) == 64
    inner = MemoryStore(storage_dtype="float32")
    router = TenantRouter(inner)
    lay = tiny.layout(SAMPLE_QUESTION, SAMPLE_CHUNKS[:1], None)
    kv = tiny.compute_chunks(lay.prefix_ids, lay.chunk_ids)[0]
    router.put(key, kv)  # outside any tenant's scope: today's key
    assert inner.keys() == [key] and key in router
    with tenant_scope("acme"):
        assert key not in router and router.get(key) is None
        router.put(key, kv)
    assert set(inner.keys()) == {key, tenant_key(key, "acme")}


def test_store_stats_by_tenant(disk_engine, tmp_path):
    from kvstitch.cli.main import app as cli_app

    app = create_app(disk_engine, security=SecurityConfig(api_keys=(PUB,), tenants=TENANTS))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        ask(c, A, SAMPLE_CHUNKS[:2])
        ask(c, B, SAMPLE_CHUNKS[:1])
    disk_engine.store.inner.put("cd" * 32, disk_engine.store.inner.get(disk_engine.store.inner.keys()[0]))
    out = CliRunner().invoke(cli_app, ["store", "stats", str(tmp_path / "kv")])
    assert out.exit_code == 0, out.output
    assert "by tenant" in out.output
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in out.output.splitlines()
            if ln.count("│") >= 3 and ln.split("│")[1].strip() in ("acme", "globex", "default")}
    assert rows == {"acme": "3", "globex": "2", "default": "1"}, out.output
