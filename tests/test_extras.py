"""Optional extras: a plain install imports without them, and a feature whose extra is missing names it."""

import pickle
import subprocess
import sys

import pytest

from kvstitch.core.errors import KVStitchError, MissingExtra
from kvstitch.core.extras import require

# every optional package (pyproject.toml's extras) and what they bring along
OPTIONAL = ("numba", "llvmlite", "fastapi", "uvicorn", "starlette", "prometheus_client", "redis", "matplotlib", "ray")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvs_fake_optional", None)  # `import kvs_fake_optional` raises ImportError
    with pytest.raises(MissingExtra) as info:
        require("kvs_fake_optional", "serve", "kvstitch serve")
    err = info.value
    assert str(err) == "kvstitch serve needs the 'serve' extra: pip install 'kvstitch[serve]'"
    assert (err.feature, err.extra) == ("kvstitch serve", "serve")
    assert isinstance(err, KVStitchError) and isinstance(err, ImportError)  # the CLI's one line; import fallbacks
    again = pickle.loads(pickle.dumps(err))  # crosses processes (Ray) intact
    assert str(again) == str(err) and again.extra == "serve"
    assert require("json", "serve", "x") is sys.modules["json"]


def test_features_without_their_extra(monkeypatch):
    from kvstitch.core.figures import new_figure
    from kvstitch.eval.rows import colour_cycle
    from kvstitch.store import open_store

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(MissingExtra, match=r"redis:// store needs the 'redis' extra: pip install 'kvstitch\[redis\]'"):
        open_store("redis://127.0.0.1:1/0")
    with pytest.raises(MissingExtra, match="'redis' extra"):
        open_store("tiered:memory,redis://127.0.0.1:1/0")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for draw in (lambda: new_figure(4, 3), colour_cycle):
        with pytest.raises(MissingExtra, match=r"pip install 'kvstitch\[plots\]'"):
            draw()


def test_cli_without_their_extra(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kvstitch.cli.main import app

    monkeypatch.setitem(sys.modules, "fastapi", None)
    out = CliRunner().invoke(app, ["serve"])  # fails before the model loads
    assert out.exit_code == 2, out.output
    assert "kvstitch serve needs the 'serve' extra: pip install 'kvstitch[serve]'" in out.output
    monkeypatch.setitem(sys.modules, "redis", None)
    out = CliRunner().invoke(app, ["store", "stats", "redis://127.0.0.1:1/0"])
    assert out.exit_code == 2 and "pip install 'kvstitch[redis]'" in out.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = CliRunner().invoke(app, ["eval", "--out", str(tmp_path / "run")])
    assert out.exit_code == 2 and "kvstitch eval needs the 'plots' extra" in out.output
    assert not (tmp_path / "run").exists()


def test_imports_without_numba():
    """The kernels' modules import without numba (the `fast` extra), and the torch path is the one taken."""
    done = _run("import sys; sys.modules['numba'] = None\n"
                "import torch, kvstitch, kvstitch.decode.paged_kernel, kvstitch.decode.append_kernel\n"
                "from kvstitch.decode import kernel_common, paged_kernel, rank_kernel\n"
                "assert not kernel_common.available() and not paged_kernel.kernel_ok(torch.float32, 'cpu')\n"
                "assert not rank_kernel.rank_ok(None, 'cpu')\n")
    assert done.returncode == 0, done.stderr


def test_import_and_help_without_any_extra():
    """``import kvstitch`` and ``kvstitch --help`` (every command's module) load no optional package."""
    done = _run(f"import sys\nfor m in {OPTIONAL!r}: sys.modules[m] = None\n"
                "import kvstitch, kvstitch.store, kvstitch.serve.server, kvstitch.eval.report\n"
                "import kvstitch.corpus.ray_precompute, kvstitch.bench.serve, kvstitch.serve.replicas\n"
                "from kvstitch.cli import app\n"
                "sys.argv = ['kvstitch', '--help']\n"
                "app()\n")
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "eval" in done.stdout
