"""`kvstitch store ...`: inspect, check and trim a chunk store (a directory or a redis:// URL).

Opening never creates anything: a path without the store marker is refused, so `gc` cannot be pointed
at an arbitrary directory. Exit codes: 0 ok, 1 `verify` found problems, 2 the store could not be used.
"""

from __future__ import annotations

import re

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstitch.core.errors import MissingExtra, StoreError
from kvstitch.store.base import ChunkStore
from kvstitch.store.disk import DiskStore
from kvstitch.store.redis_store import RedisStore

store_app = typer.Typer(help="Inspect, verify and garbage-collect a chunk KV store.", no_args_is_help=True,
                        add_completion=False)
console = Console(highlight=False)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'1073741824', '512M', '1.5GiB', '2GB' -> bytes (K/M/G alone are binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"not a size: {text!r} (e.g. 500M, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _open(path: str, fingerprint: str | None = None) -> ChunkStore:
    try:
        if path.startswith(("redis://", "rediss://", "unix://")):
            return RedisStore(path, fingerprint=fingerprint, check=True)
        return DiskStore(path, fingerprint=fingerprint, create=False)
    except (StoreError, MissingExtra) as e:
        _die(e)


def _die(err: Exception):
    console.print(f"[red]error:[/red] {escape(str(err))}", soft_wrap=True)  # escaped: "kvstitch[redis]" is no markup
    raise typer.Exit(2)


@store_app.command()
def stats(path: str = typer.Argument(..., help="store directory or redis://host:port/db")) -> None:
    """Entries, bytes, and bytes/token per storage dtype."""
    store = _open(path)
    try:
        s = store.stats()
    except StoreError as e:
        _die(e)
    console.print(f"[bold]{path}[/bold]: {s['entries']} entries, {human(s['bytes'])}"
                  + (f", {s['tmp_files']} temp files" if s.get("tmp_files") else ""), soft_wrap=True)
    if s["by_dtype"]:
        t = Table("dtype", "entries", "tokens", "bytes", "bytes/token")
        for dt, d in sorted(s["by_dtype"].items()):
            t.add_row(dt, str(d["entries"]), str(d["tokens"]), human(d["bytes"]), f"{d['bytes_per_token']:.0f}")
        console.print(t)
    if s.get("by_model"):
        t = Table("model", "fingerprint", "entries", "tokens", "bytes", title="by model")
        for fp, d in sorted(s["by_model"].items(), key=lambda kv: -kv[1]["bytes"]):
            t.add_row(d["name"], fp[:16], str(d["entries"]), str(d["tokens"]), human(d["bytes"]))
        console.print(t)
    _tenants_table(store)
    if s.get("pinned"):
        console.print(f"{s['pinned']} pinned entries (kept by gc)")
    store.close()


def _tenants_table(store: ChunkStore) -> None:
    """Entries by tenant, when a server with tenants used the store ("default": entries of no tenant)."""
    from kvstitch.store.tenants import group_by_tenant

    try:
        by = group_by_tenant(store)
    except StoreError as e:
        _die(e)
    if not by:
        return
    t = Table("tenant", "entries", "bytes", title="by tenant")
    for name, d in sorted(by.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])):
        t.add_row(name + (" (shared)" if d["shared"] else ""), str(d["entries"]), human(d["bytes"]))
    console.print(t)


@store_app.command()
def verify(path: str = typer.Argument(..., help="store directory or redis://host:port/db"),
           fingerprint: str = typer.Option(None, help="also flag entries of any other model fingerprint")) -> None:
    """Check every entry (checksum, layout, key, fingerprint); exit 1 if any would not be served."""
    store = _open(path, fingerprint)
    try:
        problems = store.verify()
        n = len(store.keys())
    except StoreError as e:
        _die(e)
    store.close()
    if not problems:
        console.print(f"[green]OK[/green]: {n} entries verified", soft_wrap=True)
        return
    t = Table("key", "problem", title=f"{len(problems)} of {n} entries have problems")
    for key, problem in problems:
        t.add_row(key, problem)
    console.print(t)
    console.print("[yellow]these entries are served as misses and overwritten on the next put[/yellow]")
    raise typer.Exit(1)


@store_app.command()
def gc(path: str = typer.Argument(..., help="store directory or redis://host:port/db"),
       max_bytes: str = typer.Option(..., "--max-bytes", help="budget to trim to, e.g. 2GiB, 500M, 0")) -> None:
    """Evict least-recently-used entries until the store fits in --max-bytes."""
    budget = parse_size(max_bytes)
    store = _open(path)
    try:
        r = store.gc(budget)
    except StoreError as e:
        _die(e)
    store.close()
    extra = f", {r['stale_tmp_removed']} stale temp files" if r.get("stale_tmp_removed") else ""
    console.print(f"removed {r['removed']} entries ({human(r['freed_bytes'])}){extra}; "
                  f"{r['entries']} entries, {human(r['bytes'])} remain (budget {human(budget)})", soft_wrap=True)
