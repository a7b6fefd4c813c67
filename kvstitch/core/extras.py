"""The optional dependencies, one pip extra per feature (pyproject.toml): each is imported where it is used,
through `require`, so ``import kvstitch`` and ``kvstitch --help`` work on a plain install and a feature whose
extra is missing fails with one line naming it.

    serve   the HTTP server (`kvstitch serve`, `kvstitch bench serve`): fastapi, uvicorn, prometheus-client, httpx
    redis   redis:// stores: redis
    plots   PNG plots (eval reports, calibrate, viz): matplotlib
    ray     ``precompute --ray``, ``serve --replicas``: ray[serve]
    fast    numba CPU decode kernels (without it the torch path runs: nothing fails)
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtra


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``, or `MissingExtra` ("FEATURE needs the 'EXTRA' extra: pip install 'kvstitch[EXTRA]'")."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(feature, extra) from e
