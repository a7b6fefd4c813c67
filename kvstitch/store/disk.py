"""A directory of safetensors entries: the embedded default, shared by every process on one machine.

Layout: ``ROOT/KVSTITCH_STORE.json`` (marker: gc never touches a directory without it) and
``ROOT/<key[:2]>/<key>.safetensors``. Writes go to a unique temp file in the same shard directory, are
fsync'ed, then ``os.replace``'d over the final name (and the directory fsync'ed), so a reader sees the
old entry, the new one, or none — never a partial one — and two writers of one key just race to
install identical, complete files. A process killed mid-write leaves at most a ``.<key>.*.tmp`` file,
which no reader opens and `gc` removes once stale. LRU: `get` refreshes the file's atime explicitly
(relatime/noatime mounts would not), `gc(max_bytes)` evicts the oldest atime first.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

import torch

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import CorruptEntryError, StoreError
from .base import LAYOUT_VERSION, ChunkStore, check_key, check_meta, group_by_model
from .codec import DEFAULT_CHECKSUM, check_storage_dtype, decode, encode, entry_info, splice_anchors

MARKER = "KVSTITCH_STORE.json"
SUFFIX = ".safetensors"
_ENTRY_RE = re.compile(r"([0-9a-f]{64})\.safetensors")
_TMP_RE = re.compile(r"\.([0-9a-f]{64})\..*\.tmp")
STALE_TMP_S = 3600.0  # a temp file this old belongs to a dead writer
_ATIME_SLACK_NS = 60 * 10**9  # refresh atime at most once a minute per entry (a hit costs no extra write)


def _write_all(fd: int, buf) -> None:
    mv = memoryview(buf).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_noatime(path: Path):
    """Open for a maintenance read (stats/verify) that must not count as a use for the LRU."""
    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:  # O_NOATIME needs ownership of the file
        fd = os.open(path, os.O_RDONLY)
    return open(fd, "rb", buffering=0)


def read_file(path: Path, noatime: bool = False) -> bytearray:
    """The whole file in one writable buffer (one copy out of the page cache; tensors view into it)."""
    with (_open_noatime(path) if noatime else open(path, "rb", buffering=0)) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        mv, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(mv[got:])
            if not n:
                del mv
                return buf[:got]  # shrank under us: the decoder reports it as truncated
            got += n
        return buf


def read_info(path: Path) -> dict:
    """An entry's metadata from its header only (stats must not read whole entries)."""
    with _open_noatime(path) as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return entry_info(head + f.read(min(n, 1 << 20)))


class DiskStore(ChunkStore):
    def __init__(self, root, storage_dtype: str = "float16", compute_dtype: torch.dtype | None = None,
                 fingerprint: str | None = None, max_bytes: int | None = None, fsync: bool = True,
                 create: bool = True, checksum_alg: str = DEFAULT_CHECKSUM) -> None:
        super().__init__()
        self.root = Path(root).expanduser()
        self.storage_dtype = check_storage_dtype(storage_dtype)
        self.compute_dtype = compute_dtype
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.checksum_alg = checksum_alg
        self._approx_bytes: int | None = None
        self._open(create)

    def _open(self, create: bool) -> None:
        marker = self.root / MARKER
        if marker.is_file():
            return
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store path {self.root} exists and is not a directory")
        if not create:
            raise StoreError(f"{self.root} is not a kvstitch store (no {MARKER})")
        # another process creating the same new store leaves only its marker's temp file: not foreign content
        if self.root.is_dir() and any(not e.name.startswith(f".{MARKER}.") for e in self.root.iterdir()):
            raise StoreError(f"{self.root} is a non-empty directory without {MARKER}: "
                             "refusing to use it as a store (pick a new or empty directory)")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{MARKER}.{os.getpid()}.{secrets.token_hex(4)}"
            tmp.write_text(json.dumps({"format": "kvstitch-store", "layout_version": LAYOUT_VERSION}) + "\n")
            os.replace(tmp, marker)
        except OSError as e:
            raise StoreError(f"cannot create store directory {self.root}: {e.strerror or e}") from None

    def __repr__(self) -> str:
        return f"DiskStore({str(self.root)!r}, storage_dtype={self.storage_dtype!r})"

    def path(self, key: str) -> Path:
        """Where `key` lives; the key is validated first, so the path cannot leave the store."""
        check_key(key)
        return self.root / key[:2] / (key + SUFFIX)

    # -- read ----------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        p = self.path(key)
        try:
            buf = read_file(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {p}: {e.strerror or e}") from None
        try:
            kv = decode(buf, key, self.fingerprint, self.compute_dtype)
        except CorruptEntryError as e:
            self._report(key, str(e))
            return None
        self._touch(p)
        return kv

    def _touch(self, p: Path) -> None:
        try:
            st = p.stat()
            now = time.time_ns()
            if now - st.st_atime_ns > _ATIME_SLACK_NS:
                os.utime(p, ns=(now, st.st_mtime_ns))
        except OSError:
            pass  # evicted meanwhile: the hit stands, the LRU clock does not matter

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    # -- write ---------------------------------------------------------------------------------
    def put(self, key: str, kv: ChunkKV) -> None:
        self._install(key, encode(key, kv, self.storage_dtype, self.checksum_alg))

    def add_anchors(self, key: str, scores: torch.Tensor, tag: str) -> bool:
        try:
            buf = read_file(self.path(key))
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(f"cannot read {self.path(key)}: {e.strerror or e}") from None
        try:
            bufs = splice_anchors(buf, key, scores, tag)
        except CorruptEntryError as e:
            self._report(key, str(e))
            return False
        self._install(key, bufs)
        return True

    def _install(self, key: str, bufs: list) -> None:
        """Write an entry's buffers to a temp file and rename it over the entry (atomic, see the module doc)."""
        final = self.path(key)
        size = sum(memoryview(b).nbytes for b in bufs)
        shard = final.parent
        tmp = shard / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            shard.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for b in bufs:
                    _write_all(fd, b)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            if not self.root.joinpath(MARKER).exists():
                raise StoreError(f"store directory {self.root} disappeared") from None
            raise StoreError(f"cannot write {final}: {e.strerror or e}") from None
        if self.fsync:
            _fsync_dir(shard)
        self._reported = {kp for kp in self._reported if kp[0] != key}  # a new entry may be reported anew
        if self.max_bytes is not None:
            if self._approx_bytes is None:
                self._approx_bytes = sum(st.st_size for _, _, st in self._scan())
            else:
                self._approx_bytes += size
            if self._approx_bytes > self.max_bytes:
                self.gc(int(self.max_bytes * 0.9))  # low watermark: not one gc per put

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    # -- maintenance ---------------------------------------------------------------------------
    def _scan(self, with_tmp: bool = False):
        """Yield (key, path, stat) of entries (and ("", path, stat) for temp files if `with_tmp`)."""
        try:
            shards = [d for d in os.scandir(self.root) if len(d.name) == 2 and d.is_dir()]
        except FileNotFoundError:
            return
        for shard in sorted(shards, key=lambda d: d.name):
            try:
                files = sorted(os.scandir(shard.path), key=lambda e: e.name)
            except FileNotFoundError:
                continue
            for e in files:
                m = _ENTRY_RE.fullmatch(e.name)
                if m is None and not (with_tmp and _TMP_RE.fullmatch(e.name)):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                yield (m.group(1) if m else ""), Path(e.path), st

    def keys(self) -> list[str]:
        return [k for k, _, _ in self._scan()]

    def __len__(self) -> int:
        return sum(1 for _ in self._scan())

    def verify(self) -> list[tuple[str, str]]:
        out = []
        for key, p, _ in self._scan():
            if p.parent.name != key[:2]:
                out.append((key, f"misplaced in shard {p.parent.name}/"))
                continue
            try:
                decode(read_file(p, noatime=True), key, self.fingerprint, None)
            except CorruptEntryError as e:
                out.append((key, str(e)))
            except FileNotFoundError:
                continue
            except OSError as e:
                out.append((key, f"unreadable: {e.strerror or e}"))
        return out

    def gc(self, max_bytes: int) -> dict:
        """Delete stale temp files, then least-recently-used entries until <= `max_bytes` remain."""
        now = time.time()
        entries, stale = [], 0
        for key, p, st in self._scan(with_tmp=True):
            if not key:
                if now - st.st_mtime > STALE_TMP_S:
                    stale += self._unlink(p) is not None
                continue
            entries.append((st.st_atime_ns, st.st_mtime_ns, p, st.st_size))
        total = sum(e[3] for e in entries)
        removed = freed = 0
        pins = self.pinned()
        for _, _, p, size in sorted(entries):
            if total <= max_bytes:
                break
            if p.name[:-len(SUFFIX)] in pins:
                continue  # pinned (`pin`): kept whatever the budget
            if self._unlink(p) is not None:
                removed, freed = removed + 1, freed + size
            total -= size  # gone either way (another gc may have taken it)
        self._approx_bytes = total
        return {"removed": removed, "freed_bytes": freed, "stale_tmp_removed": stale, "bytes": total,
                "entries": len(entries) - removed}

    @staticmethod
    def _unlink(p: Path):
        try:
            p.unlink()
            return p
        except FileNotFoundError:
            return None

    def stats(self) -> dict:
        by: dict[str, dict] = {}
        rows = []
        n = total = tmp = 0
        for key, p, st in self._scan(with_tmp=True):
            if not key:
                tmp += 1
                continue
            n, total = n + 1, total + st.st_size
            try:
                info = read_info(p)
            except (OSError, CorruptEntryError):
                info = {"storage_dtype": "unreadable", "n_tokens": 0}
            d = by.setdefault(info["storage_dtype"], {"entries": 0, "bytes": 0, "tokens": 0})
            d["entries"] += 1
            d["bytes"] += st.st_size
            d["tokens"] += info["n_tokens"]
            rows.append((info.get("fingerprint"), st.st_size, info["n_tokens"]))
        for d in by.values():
            d["bytes_per_token"] = d["bytes"] / d["tokens"] if d["tokens"] else 0.0
        return {**super().stats(), "path": str(self.root), "entries": n, "bytes": total, "tmp_files": tmp,
                "max_bytes": self.max_bytes, "by_dtype": by, "by_model": group_by_model(rows, self.models()),
                "pinned": len(self.pinned())}

    # -- metadata: ROOT/_meta/<namespace>/<name>.json, written atomically ----------------------
    def _meta_path(self, ns: str, name: str) -> Path:
        check_meta(ns, name)
        return self.root / "_meta" / ns / (name + ".json")

    def meta_put(self, ns: str, name: str, value: dict) -> None:
        p = self._meta_path(ns, name)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(value, sort_keys=True))
            os.replace(tmp, p)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {p}: {e.strerror or e}") from None

    def meta_get(self, ns: str, name: str) -> dict | None:
        try:
            return json.loads(self._meta_path(ns, name).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read store metadata {ns}/{name}: {e}") from None

    def meta_delete(self, ns: str, name: str) -> bool:
        try:
            self._meta_path(ns, name).unlink()
            return True
        except FileNotFoundError:
            return False

    def meta_list(self, ns: str) -> dict[str, dict]:
        check_meta(ns)
        d = self.root / "_meta" / ns
        out = {}
        for p in sorted(d.glob("*.json")) if d.is_dir() else []:
            try:
                out[p.name[:-5]] = json.loads(p.read_text())
            except (OSError, ValueError):
                continue  # removed or being replaced meanwhile
        return out
