"""A secured server (API keys, limits, CORS, bind refusal) and the cache-management API (/v1/documents)."""

from __future__ import annotations

import httpx
import pytest
import torch
from typer.testing import CliRunner

from kvstitch import Engine
from kvstitch.core.chunk import ChunkKV
from kvstitch.serve.server import create_app
from kvstitch.serve.testing import ServerThread
from kvstitch.serve.security import SecurityConfig, api_keys_from, check_bind
from kvstitch.store import MemoryStore, chunk_key

from .conftest import SAMPLE_CHUNKS, chat_body

KEYS = ("first-secret-key", "second-secret-key")


def chat(docs=None, **extra):
    return chat_body(docs, 3, **extra)


# ---- security ---------------------------------------------------------------------------------------
def test_api_key_required_wrong_key_refused_right_keys_accepted(tiny):
    app = create_app(tiny, security=SecurityConfig(api_keys=KEYS))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        r = c.get("/v1/models", headers={"Authorization": "Bearer not-the-key-at-all"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/chat/completions", json=chat(SAMPLE_CHUNKS[:2]), headers={"Authorization": "Basic x"})
        assert r.status_code == 401
        assert c.get("/health").status_code == 200  # load balancers probe without a key
        for k in KEYS:
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {k}"}).status_code == 200
        r = c.post("/v1/chat/completions", json=chat(SAMPLE_CHUNKS[:2]),
                   headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert r.status_code == 200, r.text
        assert 'code="401"' in c.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text


def test_body_and_passage_limits_are_413(tiny):
    sec = SecurityConfig(max_body_bytes=4000, max_documents=3, max_request_tokens=50)
    app = create_app(tiny, security=sec)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat(["word " * 1000]))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunked():  # no Content-Length: counted while read
            yield b'{"documents": ["'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"]}'
        r = c.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = c.post("/v1/chat/completions", json=chat(["a b c"] * 4))
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_documents"
        r = c.post("/v1/chat/completions", json=chat(SAMPLE_CHUNKS[:3]))  # ~60+ tokens > 50
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens"
        r = c.post("/v1/chat/completions", json=chat(SAMPLE_CHUNKS[:2]))
        assert r.status_code == 200, r.text


def test_cors_off_by_default_on_when_configured(tiny):
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    with ServerThread(create_app(tiny, security=SecurityConfig(api_keys=KEYS))) as srv:
        r = httpx.options(f"{srv.url}/v1/chat/completions", headers=pre)
        assert "access-control-allow-origin" not in r.headers
    sec = SecurityConfig(api_keys=KEYS, cors_origins=("https://app.example",))
    with ServerThread(create_app(tiny, security=sec)) as srv:
        r = httpx.options(f"{srv.url}/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 401  # CORS does not bypass authentication


def test_refuses_to_bind_a_public_address_without_a_key(monkeypatch):
    from kvstitch.cli.main import app

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded before the bind check")
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: no_load()))
    monkeypatch.delenv("KVSTITCH_API_KEY", raising=False)
    out = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert out.exit_code == 2 and "refusing to bind 0.0.0.0" in out.output
    with pytest.raises(Exception, match="refusing to bind"):
        check_bind("::", SecurityConfig())
    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, SecurityConfig())
    check_bind("0.0.0.0", SecurityConfig(insecure=True))
    check_bind("0.0.0.0", SecurityConfig(api_keys=api_keys_from(None, {"KVSTITCH_API_KEY": "k1-longkey, k2-longkey"})))
    assert api_keys_from(None, {"KVSTITCH_API_KEY": "k1-longkey, k2-longkey"}) == ("k1-longkey", "k2-longkey")
    assert api_keys_from(["flag-key-123"], {"KVSTITCH_API_KEY": "env-key-123"}) == ("flag-key-123",)
    with pytest.raises(Exception, match="at least 8"):
        SecurityConfig(api_keys=("short",))


# ---- documents ----------------------------------------------------------------------------------------
def test_document_ids_round_trip(disk_engine):
    app = create_app(disk_engine)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[:2]})
        assert r.status_code == 200, r.text
        docs = r.json()["data"]
        n = len(disk_engine.builder.canonical_prefixes())  # one cache per canonical prefix (question, chat)
        assert r.json()["kvstitch"] == {"computed": 2 * n, "already_stored": 0}
        ids = [d["id"] for d in docs]
        assert all(d["cached"] and not d["pinned"] and d["tokens"] > 0 for d in docs)
        assert len(disk_engine.store) == 2 * n  # precomputed before the response
        again = c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[0]}).json()
        assert again["data"][0]["id"] == ids[0] and again["kvstitch"]["already_stored"] == n
        got = c.get(f"/v1/documents/{ids[1]}").json()
        assert got["object"] == "document" and got["cached"] and got["chars"] == len(SAMPLE_CHUNKS[1])
        assert {d["id"] for d in c.get("/v1/documents").json()["data"]} == set(ids)

        by_id = c.post("/v1/chat/completions", json=chat(document_ids=ids))
        assert by_id.status_code == 200, by_id.text
        ext = by_id.json()["kvstitch"]
        # both passages are hits; the conversation's system segment (segment 0) is computed once, here
        assert ext["store_hits"] == 2 and ext["store_misses"] == 1
        inline = c.post("/v1/chat/completions", json=chat(SAMPLE_CHUNKS[:2])).json()
        assert by_id.json()["choices"][0]["message"] == inline["choices"][0]["message"]

        r = c.delete(f"/v1/documents/{ids[0]}")
        assert r.status_code == 200 and r.json() == {"id": ids[0], "object": "document.deleted", "deleted": True}
        assert c.get(f"/v1/documents/{ids[0]}").status_code == 404
        assert c.delete(f"/v1/documents/{ids[0]}").status_code == 404
        r = c.post("/v1/chat/completions", json=chat(document_ids=ids))
        assert r.status_code == 404 and r.json()["error"]["code"] == "document_not_found"
        assert len(disk_engine.store) == n + 1  # its chunk caches went with it (the segment's stays)
        assert c.post("/v1/chat/completions", json=chat(SAMPLE_CHUNKS[:1], document_ids=ids[1:])).status_code == 400
        assert c.post("/v1/documents", json={"text": []}).status_code == 400
        assert c.post("/v1/documents", json={"text": "x", "pin": "yes"}).status_code == 400
        assert c.get("/v1/documents/../../etc").status_code == 404


def test_pinned_document_survives_gc_that_evicts_unpinned(disk_engine, tmp_path):
    from kvstitch.cli.main import app as cli_app

    app = create_app(disk_engine)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        pinned = c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[0], "pin": True}).json()["data"][0]
        loose = c.post("/v1/documents", json={"text": SAMPLE_CHUNKS[1:3]}).json()["data"]
        assert pinned["pinned"] and not any(d["pinned"] for d in loose)
        out = CliRunner().invoke(cli_app, ["store", "gc", str(tmp_path / "kv"), "--max-bytes", "0"])
        assert out.exit_code == 0, out.output
        n = len(disk_engine.builder.canonical_prefixes())  # one cache per canonical prefix (question, chat)
        assert f"removed {2 * n} entries" in out.output
        assert c.get(f"/v1/documents/{pinned['id']}").json()["cached"] is True
        assert all(c.get(f"/v1/documents/{d['id']}").json()["cached"] is False for d in loose)
        r = c.post("/v1/chat/completions", json=chat(document_ids=[pinned["id"], loose[0]["id"]]))
        assert r.status_code == 200 and r.json()["kvstitch"]["store_hits"] == 1  # the evicted one is recomputed
        stats = CliRunner().invoke(cli_app, ["store", "stats", str(tmp_path / "kv")])
        assert f"{n} pinned entries" in stats.output and "by model" in stats.output


def _kv(n=64, fp="m"):
    return ChunkKV(torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 8), torch.arange(n), 4, fp)


def test_memory_tier_eviction_keeps_pins():
    one = _kv().nbytes
    s = MemoryStore(max_bytes=3 * one, storage_dtype="float32")
    keys = [chunk_key("m", [1], [i], "float32") for i in range(6)]
    s.put(keys[0], _kv())
    s.pin(keys[0])
    for k in keys[1:]:
        s.put(k, _kv())
    assert keys[0] in s and len(s) == 3 and keys[5] in s and keys[1] not in s  # evicted among the unpinned
    assert s.gc(0)["entries"] == 1 and keys[0] in s
    assert s.unpin(keys[0]) and s.gc(0)["entries"] == 0


# ---- a store outage is not an outage ------------------------------------------------------------------
def test_redis_stopped_and_restarted_mid_stream_loses_no_request(tiny):
    import shutil
    import subprocess
    import time

    from kvstitch.store import RedisStore
    from kvstitch.store.resilient import ResilientStore

    from .conftest import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cmd = [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]

    def start():
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                RedisStore(url, check=True, connect_timeout=0.2).close()
                return p
            except Exception:  # noqa: BLE001
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    proc = start()
    # cold_path="stitched": a request computes its missing chunks itself, so the outage changes nothing visible
    shared = Engine(tiny.model, tiny.tokenizer, "tiny-llama", check_rope=False, cold_path="stitched",
                    store=ResilientStore(RedisStore(url, compute_dtype=torch.float32), retry_after_s=0.2))
    healthy = Engine(tiny.model, tiny.tokenizer, "tiny-llama", check_rope=False, cold_path="stitched",
                     store=MemoryStore(storage_dtype="float16", compute_dtype=torch.float32))
    extra = [f"Note {i}: the courier number {i} delivers to gate {i * 7 % 13}." for i in range(9)]
    bodies = [chat([SAMPLE_CHUNKS[i % 4], extra[i], SAMPLE_CHUNKS[(i + 1) % 4]]) for i in range(9)]
    try:
        with ServerThread(create_app(healthy)) as ref_srv:
            expected = [httpx.post(f"{ref_srv.url}/v1/chat/completions", json=b, timeout=120).json() for b in bodies]
        with ServerThread(create_app(shared)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            got = []
            for i, b in enumerate(bodies):
                if i == 3:
                    proc.terminate()
                    proc.wait(10)
                if i == 6:
                    h = c.get("/health").json()
                    assert h["status"] == "ok" and h["store"]["status"] == "down" and h["store"]["last_error"]
                    m = c.get("/metrics").text
                    assert "kvstitch_store_up 0" in m and "kvstitch_store_outages_total 1" in m
                    proc = start()
                    time.sleep(0.3)  # past the retry interval
                r = c.post("/v1/chat/completions", json=b)
                assert r.status_code == 200, (i, r.text)
                got.append(r.json())
            assert c.get("/health").json()["store"]["status"] == "up"
            stored = RedisStore(url).keys()
        for e, g in zip(expected, got):
            assert g["choices"][0]["message"] == e["choices"][0]["message"]
        # computed while the store was down: 3 passages + the conversation's system segment
        assert [g["kvstitch"]["store_misses"] for g in got[3:6]] == [4, 4, 4]
        # writes resumed: the chunks of the last requests are stored again
        lay = shared.layout(None, bodies[8]["documents"], bodies[8]["messages"])  # the server's conversation layout
        keys = {shared.chunk_key(lay.prefix_ids, ids) for ids in lay.chunk_ids}
        assert keys <= set(stored)
    finally:
        proc.terminate()
        proc.wait(10)


# ---- one configuration --------------------------------------------------------------------------------
def test_serve_config_flags_over_env_over_file(monkeypatch, tmp_path):
    import uvicorn

    from kvstitch.serve import server
    from kvstitch.cli.main import app

    seen = {}

    class FakeEngine:
        store = MemoryStore()
        dtype = torch.float32

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: seen.update(load=k) or FakeEngine()))
    monkeypatch.setattr(server, "create_app", lambda eng, **kw: seen.update(kw) or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, log_level: seen.update(host=host, port=port))
    cfg = tmp_path / "kvstitch.toml"
    cfg.write_text('[serve]\nport = 7000\nmethod = "random"\nmax-queue = 3\nratio = 0.1\nhost = "0.0.0.0"\n'
                   'api_key = ["file-key-123456"]\ndtype = "fast"\n')
    monkeypatch.setenv("KVSTITCH_PORT", "9000")
    monkeypatch.setenv("KVSTITCH_RATIO", "0.3")
    monkeypatch.delenv("KVSTITCH_API_KEY", raising=False)
    out = CliRunner().invoke(app, ["serve", "--config", str(cfg), "--ratio", "0.5"])
    assert out.exit_code == 0, out.output
    assert seen["port"] == 9000 and seen["host"] == "0.0.0.0"  # env over file; file over default
    assert seen["default_ratio"] == 0.5 and seen["default_method"] == "random" and seen["max_queue"] == 3
    assert seen["security"].api_keys == ("file-key-123456",)  # the key let it bind 0.0.0.0
    assert seen["load"]["dtype"] == "fast"  # the model dtype reaches Engine.load
    assert out.output.count("configuration (flag > env") == 1
    for part in ("port=9000 (env)", "ratio=0.5 (flag)", "method=random (file)", "api_key=<1 key> (file)",
                 "decode=dense (default)"):
        assert part in out.output
    assert "file-key-123456" not in out.output
    cfg.write_text("prot = 1\n")
    out = CliRunner().invoke(app, ["serve", "--config", str(cfg)])
    assert out.exit_code == 2 and "unknown option 'prot'" in out.output
