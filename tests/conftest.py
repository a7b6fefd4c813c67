"""Shared fixtures: tiny random-initialised models of every supported family, and the real models."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the cores are shared by the xdist workers: each gets its share (at most 2 threads)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))

from kvstitch import Engine  # noqa: E402
from kvstitch.core.attention import ATTN_IMPL, register  # noqa: E402
from kvstitch.models.loader import resolve_model  # noqa: E402
from kvstitch.store import MemoryStore  # noqa: E402



def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker a core, at most 4 (each worker loads the real models once)."""
    return max(1, min(4, os.cpu_count() or 1))


SAMPLE_CHUNKS = [
    "Alice's house is in Paris. The summer festival had ten thousand visitors this year.",
    "Bob lives in Rome, near the old bridge. The city library opens at nine in the morning.",
    "The special magic number for Carol is 74123. Cats like to sleep in the afternoon sun.",
    "A new coffee shop opened near the central park last week; it sells green tea as well.",
]
SAMPLE_QUESTION = "What is the special magic number for Carol?"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def tiny_configs() -> dict:
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**_COMMON),
        "llama-linear": LlamaConfig(**_COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 10000.0}),
        "llama-llama3": LlamaConfig(**_COMMON, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256, "rope_theta": 500000.0}),
        "llama-yarn": LlamaConfig(**_COMMON, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}),
        "mistral-window": MistralConfig(**_COMMON, sliding_window=24),
        "qwen2": Qwen2Config(**_COMMON),
        "qwen3": Qwen3Config(**_COMMON),
        "gemma3": Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 6}, sliding_window=24,
                                   layer_types=["sliding_attention"] * 2 + ["full_attention"] +
                                   ["sliding_attention"] * 2 + ["full_attention"]),
    }


TINY = sorted(tiny_configs())


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    path, _ = resolve_model("smollm2")
    return AutoTokenizer.from_pretrained(str(path))


_tiny_cache: dict = {}


@pytest.fixture
def tiny_engine(request, smollm_tokenizer):
    """An Engine over a tiny random model of family `request.param` (SmolLM2's tokenizer)."""
    return make_tiny_engine(request.param, smollm_tokenizer)


def make_tiny_engine(name: str, tokenizer) -> Engine:
    if name not in _tiny_cache:
        _tiny_cache[name] = new_tiny_engine(name, tokenizer)
    return _tiny_cache[name]


def new_tiny_engine(name: str, tokenizer) -> Engine:
    """A tiny random model of family ``name`` in an engine of its own (not shared: for tests that change it)."""
    from transformers import AutoModelForCausalLM

    register()
    cfg = tiny_configs()[name]
    cfg.vocab_size = len(tokenizer)
    cfg.pad_token_id = cfg.bos_token_id = tokenizer.bos_token_id
    cfg.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPL, dtype=torch.float32).eval()
    # random init gives near-uniform logits; sharpen so greedy answers are meaningful to compare
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    # float32 storage: the exactness gates compare against full prefill at float32 precision;
    # cold_path="stitched": the suite tests the stitched mechanism, also on a cold store (tests/test_cold.py
    # covers the default "auto" policy)
    return Engine(model, tokenizer, weights_id=f"tiny-{name}", store=MemoryStore(storage_dtype="float32"),
                  cold_path="stitched")


@pytest.fixture(scope="session")
def smollm():
    return Engine.load(cold_path="stitched")


@pytest.fixture(scope="session")
def gemma():
    return Engine.load("gemma3", cold_path="stitched")


@pytest.fixture(scope="session")
def qwen():
    """The reference model (Qwen2.5-Coder-0.5B-Instruct, assembled from its six part wheels)."""
    return Engine.load("qwen2.5-0.5b", cold_path="stitched")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url():
    """A loopback redis-server (no persistence) for the session; without redis-server the tests FAIL."""
    from kvstitch.core.errors import StoreError
    from kvstitch.store import RedisStore

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: `apt-get install -y redis-server` (required, not skipped)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--protected-mode", "yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                RedisStore(url, check=True, connect_timeout=0.2).close()
                break
            except StoreError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {port} (exit {proc.poll()})")
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


# ---- the servers' tests: the tiny llama served on a loopback port, over its own directory store ----
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return make_tiny_engine("llama", smollm_tokenizer)


@pytest.fixture(scope="module")
def collections_dir(tmp_path_factory, engine):
    from kvstitch.corpus.retrieval import build_index

    docs = tmp_path_factory.mktemp("server_docs")
    (docs / "carol.txt").write_text("The special magic number for Carol is 74123. Carol keeps it in a red notebook.")
    (docs / "weather.txt").write_text("It rained all week in Rome. The forecast says sun on Sunday.")
    (docs / "coffee.md").write_text("A new coffee shop opened near the central park; it also sells green tea.")
    root = tmp_path_factory.mktemp("collections")
    build_index(engine, docs, "facts", root, chunk_tokens=64, block_chunks=1, embedder="bm25", precompute=True)
    return root


@pytest.fixture(scope="module")
def server(engine, collections_dir):
    from kvstitch.serve.server import create_app
    from kvstitch.serve.testing import ServerThread

    app = create_app(engine, default_method="random", default_ratio=0.2, max_queue=MAX_QUEUE,
                     collections_dir=collections_dir, model_name="tiny-llama")
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny(engine):
    return engine


@pytest.fixture
def disk_engine(tiny, tmp_path):
    """The tiny model over its own directory store (what `kvstitch store gc` operates on)."""
    from kvstitch.store import DiskStore

    return Engine(tiny.model, tiny.tokenizer, "tiny-llama", store=DiskStore(tmp_path / "kv", storage_dtype="float32"),
                  check_rope=False, cold_path="stitched")


def chat_body(docs=None, max_tokens: int = 3, **extra) -> dict:
    """A chat completion body asking SAMPLE_QUESTION (over inline ``docs`` when given)."""
    body = {"messages": [{"role": "user", "content": SAMPLE_QUESTION}], "method": "random", "ratio": 0.2,
            "max_tokens": max_tokens, **extra}
    if docs is not None:
        body["documents"] = docs
    return body
