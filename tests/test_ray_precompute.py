"""Distributed precompute on a local Ray cluster (2 CPUs, 2 workers) into a shared Redis store.

Ray is installed by scripts/setup.sh (the `kvstitch[ray]` extra): without it these tests FAIL."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

import ray  # noqa: E402 - required, not skipped
from kvstitch import Engine
from kvstitch.engine.precompute import directory_chunks, precompute_directory
from kvstitch.corpus.ray_precompute import RayPrecompute
from kvstitch.store import RedisStore

from .conftest import make_tiny_engine

CHUNK_TOKENS, BATCH = 32, 2
PREFIX = "kvstitch:chunk:"


@pytest.fixture(scope="module")
def ray_cluster():
    root = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20,
             runtime_env={"env_vars": env})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    """The tiny random llama as an HF directory (what a worker loads by path)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_engine("llama", smollm_tokenizer).model.save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    rng = random.Random(0)
    words = ("river bank stone garden window copper lantern harbor meadow violet signal orchard thunder "
             "pencil marble canyon ribbon falcon cactus glacier").split()
    d = tmp_path_factory.mktemp("ray_docs")
    for i in range(6):
        sents = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 12))).capitalize() + "."
                 for _ in range(rng.randint(5, 9))]
        (d / f"doc{i}.txt").write_text(" ".join(sents))
    (d / "copy.txt").write_text((d / "doc0.txt").read_text())  # repeated text: computed once
    return d


def _db(url: str, n: int) -> str:
    url = url.rsplit("/", 1)[0] + f"/{n}"
    RedisStore(url)._r.flushdb()
    return url


def _entries(url: str) -> dict[str, bytes]:
    r = RedisStore(url)._r
    return {k.decode()[len(PREFIX):]: r.get(k) for k in r.scan_iter(match=PREFIX + "*")}


@pytest.mark.long
def test_two_ray_workers_match_a_single_process_precompute(ray_cluster, redis_url, tiny_dir, docs):
    single, dist = _db(redis_url, 4), _db(redis_url, 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: same kernels, same bits
    try:
        eng = Engine.load(str(tiny_dir), store=single)
        ref, chunks = precompute_directory(eng, docs, CHUNK_TOKENS, batch_size=BATCH, progress=False)
    finally:
        torch.set_num_threads(threads)
    n = len(eng.builder.canonical_prefixes())  # one cache per chunk and canonical prefix (question, chat)
    assert ref.computed >= 8 and ref.computed < ref.chunks * n  # the copied document's chunks are not recomputed

    job = RayPrecompute(docs, dist, model=str(tiny_dir), workers=2, chunk_tokens=CHUNK_TOKENS, batch_size=BATCH)
    try:
        rep = job.run(progress=False)
        assert rep.chunks == ref.chunks and rep.computed == ref.computed and rep.tokens == ref.tokens
        assert len(rep.per_worker) == 2  # both workers computed batches
        again = job.run(progress=False)  # resumable / idempotent: everything is stored
        assert again.computed == 0 and again.skipped == ref.computed and again.batches == 0
    finally:
        job.shutdown()
    a, b = _entries(single), _entries(dist)
    assert len(a) == ref.computed and set(a) == set(b)
    assert all(a[k] == b[k] for k in a)  # every entry byte-identical (header, checksum, tensors)


class SetCounter:
    """Counts Redis SETs per key (keyspace notifications) while a job runs."""

    def __init__(self, url: str, db: int):
        self.r = RedisStore(url)._r
        self.r.config_set("notify-keyspace-events", "E$")
        self.ps = self.r.pubsub()
        self.ps.psubscribe(f"__keyevent@{db}__:set")
        self.counts: Counter = Counter()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            m = self.ps.get_message(timeout=0.1)
            if m and m["type"] == "pmessage":
                self.counts[m["data"].decode()] += 1

    def stop(self):
        import time

        time.sleep(0.5)  # drain the last notifications
        self._stop.set()
        self.thread.join(5)
        self.ps.close()


@pytest.mark.long
def test_a_killed_worker_loses_only_its_batch_and_the_job_completes(ray_cluster, redis_url, tiny_dir,
                                                                      docs, smollm_tokenizer):
    url = _db(redis_url, 6)
    eng = Engine.load(str(tiny_dir))
    pairs, ids = directory_chunks(eng, docs, CHUNK_TOKENS)
    expected = {eng.chunk_key(p, i) for p in eng.builder.canonical_prefixes() for i in ids}  # question + chat
    counter = SetCounter(url, 6)
    job = RayPrecompute(docs, url, model=str(tiny_dir), workers=2, chunk_tokens=CHUNK_TOKENS, batch_size=BATCH)
    killed = {}
    try:
        job.start()
        pids = [p["pid"] for p in ray.get([a.info.remote() for a in job.actors])]

        def kill_once(j, res):
            if not killed:  # the first finished batch: the other worker still has batches in flight
                victim = 1 if res["pid"] == pids[0] else 0
                killed.update(victim=victim, pid=pids[victim], done=res["batch"],
                              inflight=sum(1 for a, *_ in j.inflight.values() if a is j.actors[victim]))
                ray.kill(j.actors[victim], no_restart=False)  # the process dies; Ray restarts the actor
        rep = job.run(progress=False, on_result=kill_once)
        assert killed and killed["inflight"] >= 1  # it died with a batch in flight (mid-run)
        assert 0 < rep.computed <= len(expected)  # a retried batch skips what its dead run stored
        new_pid = ray.get(job.actors[killed["victim"]].info.remote())["pid"]
        assert new_pid != killed["pid"]  # it really died and came back
    finally:
        job.shutdown()
        counter.stop()
    chunk_sets = {k[len(PREFIX):]: n for k, n in counter.counts.items() if k.startswith(PREFIX)}
    assert set(chunk_sets) == expected == set(_entries(url))  # the job completed
    assert all(n == 1 for n in chunk_sets.values()), chunk_sets  # every chunk stored exactly once
    assert RedisStore(url).verify() == []


def test_ray_flag_without_ray_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    from typer.testing import CliRunner

    from kvstitch.cli.main import app

    (tmp_path / "a.txt").write_text("A short document.")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = CliRunner().invoke(app, ["precompute", str(tmp_path), "--store", "redis://127.0.0.1:1/0", "--ray"])
    assert out.exit_code == 2 and "pip install 'kvstitch[ray]'" in out.output
    monkeypatch.setitem(sys.modules, "ray", ray)
    out = CliRunner().invoke(app, ["precompute", str(tmp_path), "--store", "memory", "--ray"])
    assert out.exit_code == 2 and "shared --store" in out.output


@pytest.mark.long
def test_bench_precompute_single_vs_ray(ray_cluster, tiny_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from kvstitch.cli.main import app

    out = CliRunner().invoke(app, ["bench", "precompute", "--ray-workers", "0,1", "--docs", "2", "--words", "80",
                                   "--chunk-tokens", "32", "--batch-size", "2", "--model", str(tiny_dir),
                                   "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    rows = json.loads((tmp_path / "bench_precompute.json").read_text())["rows"]
    assert [r["workers"] for r in rows] == [0, 1]
    # fresh store each; one cache per chunk and canonical prefix (question and chat layouts)
    assert rows[0]["computed"] == rows[1]["computed"] and rows[0]["chunks"] > 0
    assert rows[0]["computed"] % rows[0]["chunks"] == 0 and rows[0]["computed"] >= rows[0]["chunks"]
    assert rows[0]["tokens"] == rows[1]["tokens"] and all(r["tokens_per_s"] > 0 for r in rows)
    assert "| Ray, 1 worker |" in (tmp_path / "bench_precompute.md").read_text()


@pytest.mark.long
def test_store_lost_mid_run_fails_the_job_with_a_clear_message(ray_cluster, tiny_dir, docs):
    import shutil
    import subprocess
    import time

    from kvstitch.core.errors import KVStitchError

    from .conftest import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            RedisStore(url, check=True, connect_timeout=0.2).close()
            break
        except Exception:  # noqa: BLE001
            time.sleep(0.05)
    job = RayPrecompute(docs, url, model=str(tiny_dir), workers=2, chunk_tokens=CHUNK_TOKENS, batch_size=1,
                        max_attempts=3)

    stopped: list[float] = []

    def stop_store(j, res):
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
            stopped.append(time.monotonic())
    try:
        with pytest.raises(KVStitchError, match=r"failed 3 times .*StoreError: Redis at .* unavailable"):
            job.run(progress=False, on_result=stop_store)
    finally:
        job.shutdown()
        if proc.poll() is None:
            proc.terminate()
    # retried with backoff, then failed: no hang. Timed from the store's loss, not from the start: starting the
    # Ray workers alone took over a minute on 2 busy cores.
    assert stopped and time.monotonic() - stopped[0] < 120
