"""One configuration for `kvstitch serve`: flags > ``KVSTITCH_*`` environment variables > a TOML file.

    kvstitch serve --config kvstitch.toml            # or KVSTITCH_CONFIG=kvstitch.toml
    KVSTITCH_PORT=9000 KVSTITCH_API_KEY=k1,k2 kvstitch serve --config kvstitch.toml --method infoflow

Every serve option has an environment variable: ``KVSTITCH_`` + its name in capitals with ``_`` for
``-`` (``--max-queue`` -> ``KVSTITCH_MAX_QUEUE``). The file holds the same names, at the top level or
under ``[serve]`` (``max_queue = 8`` or ``max-queue = 8``); an unknown name is an error, not ignored.
The effective configuration, and where each value came from, is printed once at start (keys masked).
"""

from __future__ import annotations

from pathlib import Path

import typer

from .errors import InputError

ENV_PREFIX = "KVSTITCH"
SECRET = {"api_key"}


def read_config(path: str | Path, known: set[str]) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise InputError("reading --config needs Python >= 3.11 (tomllib) or `pip install tomli`") from None
    p = Path(path).expanduser()
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"config file not found: {p}") from None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read config file {p}: {e}") from None
    if isinstance(data.get("serve"), dict):
        data = {**{k: v for k, v in data.items() if k != "serve"}, **data["serve"]}
    out = {}
    for k, v in data.items():
        name = k.replace("-", "_")
        if name not in known:
            raise InputError(f"{p}: unknown option {k!r}; known: {', '.join(sorted(known))}")
        out[name] = v
    return out


def config_callback(ctx: typer.Context, param: typer.CallbackParam, value):
    """Eager ``--config``: the file's values become the defaults of the other options (under env and flags)."""
    if value:
        known = {p.name for p in ctx.command.params if p.name not in ("config",)}
        try:
            values = read_config(value, known)
        except InputError as e:  # raised while parsing: a usage error (exit 2), not a traceback
            raise typer.BadParameter(str(e), ctx=ctx, param=param) from None
        ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


def describe(ctx: typer.Context) -> list[tuple[str, str, str]]:
    """``(option, value, source)`` for every serve option (source: flag, env, file or default)."""
    names = {"COMMANDLINE": "flag", "ENVIRONMENT": "env", "DEFAULT_MAP": "file", "DEFAULT": "default"}
    rows = []
    for p in ctx.command.params:
        if p.name in ("install_completion", "show_completion", "help") or getattr(p, "hidden", False):
            continue
        v = ctx.params.get(p.name)
        if p.name in SECRET and v:
            n = sum(len([k for k in str(x).split(",") if k.strip()]) for x in v)
            v = f"<{n} key{'s' if n != 1 else ''}>"
        src = ctx.get_parameter_source(p.name)
        rows.append((p.name, str(v), names.get(getattr(src, "name", ""), "default")))
    return rows


def print_config(ctx: typer.Context, console) -> None:
    """The effective serve configuration, once, at start."""
    rows = describe(ctx)
    console.print("configuration (flag > env KVSTITCH_* > file > default): "
                  + ", ".join(f"{n}={v} ({s})" for n, v, s in rows), highlight=False, soft_wrap=True)
