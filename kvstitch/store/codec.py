"""One stored entry = one safetensors blob (no pickle), self-describing and self-checking.

Layout (``LAYOUT_VERSION`` 1). A standard safetensors file, readable by ``safetensors.torch.load``:

    8-byte little-endian header length | JSON header (space-padded so the data starts 64-byte aligned) | data

Tensors, in file order (largest first, so they start aligned):

    float16 / bfloat16 / float32 storage:
        keys        [L, kv_heads, n, head_dim]   storage dtype, post-RoPE at positions start..start+n-1
        values      [L, kv_heads, n, head_dim]   storage dtype
    int8 storage (KIVI, see quant.py):
        keys.q      [L, kv_heads, n, head_dim]   uint8, per-channel:  k = q * keys.scale + keys.zero
        values.q    [L, kv_heads, n, head_dim]   uint8, per-token:    v = q * values.scale + values.zero
        values.scale, values.zero  [L, kv_heads, n, 1]   float32
        keys.scale,   keys.zero    [L, kv_heads, 1, head_dim] float32
    always:
        token_ids   [n]  int64
    when QCFuse's anchor pass ran for the chunk (`ChunkKV.anchor_scores`; metadata ``anchor_tag`` names it):
        anchor_scores [L, n] float32 (last: `splice_anchors` adds it to a stored entry without touching the K/V)

Layer-major: layer i of ``keys`` is the contiguous byte range ``i * H*n*d*itemsize`` onwards.

``__metadata__`` (all strings): format="kvstitch-chunk", layout_version, key, fingerprint, start,
n_tokens, storage_dtype, shape (L,H,n,d), checksum_alg, checksum. The checksum is over the canonical
header JSON *without* the checksum field, then the whole data region, so a flipped bit anywhere — tensor
bytes, offsets, fingerprint, start — is caught. The default is xxh3-128 (``xxhash``): the checksum guards
against corruption and partial writes, not against an attacker (whoever can rewrite an entry can rewrite
its checksum), so a fast 128-bit hash protects as well as a cryptographic one. Verification dominated
the load path with sha256 (73% of a warm disk get at ~1.3-1.8 GB/s on one core); xxh3 runs at >10 GB/s.
Entries name their algorithm, so sha256 / blake2b / crc32 entries (older stores) still read.
Store keys stay sha256 content addresses (`kvstitch.store.base`).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib

import torch
import xxhash

from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import CorruptEntryError, StoreError
from .base import LAYOUT_VERSION
from .quant import dequantize, quantize_keys, quantize_values

FORMAT = "kvstitch-chunk"
STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                  "int8": torch.uint8}
_ST = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64"}
_TORCH = {v: k for k, v in _ST.items()}
_ALIGN = 64
_MAX_HEADER = 1 << 20
DEFAULT_CHECKSUM = "xxh3_128"


def check_storage_dtype(name) -> str:
    """Normalize a storage-dtype name ("fp16", torch.float16, ... accepted) or raise StoreError."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
               "uint8": "int8", "q8": "int8"}
    name = aliases.get(str(name).lower(), str(name).lower())
    if name not in STORAGE_DTYPES:
        raise StoreError(f"unsupported storage dtype {name!r}; choose one of {', '.join(STORAGE_DTYPES)}")
    return name


def _hasher(alg: str):
    if alg == "xxh3_128":
        return xxhash.xxh3_128()
    if alg == "sha256":
        return hashlib.sha256()
    if alg == "blake2b":
        return hashlib.blake2b(digest_size=32)
    if alg == "crc32":
        return _Crc32()
    raise CorruptEntryError(f"unknown checksum algorithm {alg!r}")


class _Crc32:
    def __init__(self) -> None:
        self.v = 0

    def update(self, b) -> None:
        self.v = zlib.crc32(b, self.v)

    def hexdigest(self) -> str:
        return f"{self.v:08x}"


def _canonical(header: dict) -> bytes:
    meta = {k: v for k, v in header["__metadata__"].items() if k != "checksum"}
    return json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":")).encode()


def _finite(t: torch.Tensor) -> bool:
    """All elements finite? aminmax propagates NaN and shows +-inf, ~20x cheaper than isfinite().all()."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# -- encode --------------------------------------------------------------------------------------------

def storage_tensors(kv: ChunkKV, storage_dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of one entry in file order (see module doc). Refuses values float16 cannot hold."""
    keys, values = kv.keys.detach().cpu(), kv.values.detach().cpu()
    if storage_dtype == "int8":
        kq, ks, kz = quantize_keys(keys)
        vq, vs, vz = quantize_values(values)
        out = {"keys.q": kq, "values.q": vq, "values.scale": vs, "values.zero": vz, "keys.scale": ks,
               "keys.zero": kz}
        check = (ks, kz, vs, vz)
    else:
        dt = STORAGE_DTYPES[storage_dtype]
        out = {"keys": keys.to(dt).contiguous(), "values": values.to(dt).contiguous()}
        check = (out["keys"], out["values"])
    if not all(_finite(t) for t in check):
        raise StoreError(f"chunk K/V is not finite in {storage_dtype} storage (overflow?); "
                         "use bfloat16 or float32 storage")
    out["token_ids"] = kv.token_ids.detach().cpu().to(torch.int64).reshape(-1).contiguous()
    if kv.anchor_scores is not None:
        out[ANCHORS] = kv.anchor_scores.detach().cpu().float().contiguous()
    return out


def encode(key: str, kv: ChunkKV, storage_dtype: str = "float16",
           checksum_alg: str = DEFAULT_CHECKSUM) -> list:
    """Serialize `kv` as a list of byte buffers (header first) to be written back to back: no joined copy."""
    tensors = storage_tensors(kv, storage_dtype)
    meta = {"format": FORMAT, "layout_version": str(LAYOUT_VERSION), "key": key, "fingerprint": kv.fingerprint,
            "start": str(int(kv.start)), "n_tokens": str(kv.n_tokens), "storage_dtype": storage_dtype,
            "shape": ",".join(map(str, kv.keys.shape)), "checksum_alg": checksum_alg}
    if kv.anchor_scores is not None:
        meta["anchor_tag"] = kv.anchor_tag
    header: dict = {"__metadata__": meta}
    views, off = [], 0
    for name, t in tensors.items():
        mv = _bytes_of(t)
        header[name] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + mv.nbytes]}
        views.append(mv)
        off += mv.nbytes
    return _sealed(header, views, checksum_alg)


def _sealed(header: dict, views: list, checksum_alg: str) -> list:
    """Checksum ``header`` + ``views``, pad the header -> the entry's byte buffers (header first)."""
    h = _hasher(checksum_alg)
    h.update(_canonical(header))
    for mv in views:
        h.update(mv)
    header["__metadata__"]["checksum"] = h.hexdigest()
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % _ALIGN)
    return [struct.pack("<Q", len(hb)) + hb, *views]


def splice_anchors(buf, key: str, scores: torch.Tensor, tag: str) -> list:
    """A stored entry with anchor scores ``scores`` [L, n] (tag ``tag``) added or replaced: its K/V bytes are
    copied as they are (no re-encoding, so any storage dtype loads bit-identical after), the checksum renewed.
    CorruptEntryError if the entry is damaged or ``scores`` does not fit it."""
    kv = decode(buf, key)  # every check of a read
    scores = scores.detach().cpu().float().contiguous()
    if tuple(scores.shape) != (kv.keys.shape[0], kv.n_tokens) or not tag:
        raise CorruptEntryError(f"anchor scores {tuple(scores.shape)} (tag {tag!r}) do not fit an entry of "
                                f"{kv.keys.shape[0]} layers x {kv.n_tokens} tokens")
    header, data0 = parse_header(buf)
    old = header.pop(ANCHORS, None)
    end = max(int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__")
    if old is not None:
        end = min(end, int(old["data_offsets"][0]))
    anchors = _bytes_of(scores)
    header[ANCHORS] = {"dtype": "F32", "shape": list(scores.shape), "data_offsets": [end, end + anchors.nbytes]}
    meta = header["__metadata__"]
    meta.pop("checksum", None)
    meta["anchor_tag"] = tag
    return _sealed(header, [memoryview(buf)[data0:data0 + end], anchors], meta.get("checksum_alg", DEFAULT_CHECKSUM))


def encode_bytes(key: str, kv: ChunkKV, storage_dtype: str = "float16",
                 checksum_alg: str = DEFAULT_CHECKSUM) -> bytes:
    return b"".join(encode(key, kv, storage_dtype, checksum_alg))


# -- decode --------------------------------------------------------------------------------------------

def parse_header(buf) -> tuple[dict, int]:
    """(header dict, data start offset) from the first bytes of an entry; CorruptEntryError if malformed."""
    if len(buf) < 8:
        raise CorruptEntryError(f"truncated: {len(buf)} bytes, no header")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > _MAX_HEADER:
        raise CorruptEntryError(f"header length {n} is implausible (not a kvstitch entry?)")
    if len(buf) < 8 + n:
        raise CorruptEntryError(f"truncated: {len(buf)} bytes, header needs {8 + n}")
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
        meta = header["__metadata__"]
        assert isinstance(meta, dict)
    except Exception as e:  # noqa: BLE001 - any parse failure is the same verdict
        raise CorruptEntryError(f"unreadable header ({type(e).__name__})") from None
    if meta.get("format") != FORMAT:
        raise CorruptEntryError(f"not a kvstitch chunk entry (format={meta.get('format')!r})")
    if meta.get("layout_version") != str(LAYOUT_VERSION):
        raise CorruptEntryError(f"layout version {meta.get('layout_version')} (this build reads {LAYOUT_VERSION})")
    return header, 8 + n


ANCHORS = "anchor_scores"


def _expected_names(storage_dtype: str) -> set[str]:
    if storage_dtype == "int8":
        return {"keys.q", "values.q", "values.scale", "values.zero", "keys.scale", "keys.zero", "token_ids"}
    return {"keys", "values", "token_ids"}


def _tensor_spans(header: dict, names: set[str], data_len: int) -> tuple[dict, int]:
    """``{name: (dtype, shape, data offset)}`` of the entry's tensors and the end of their data, checked against
    the ``data_len`` bytes after the header (each span its shape's size, none past the end, no bytes after)."""
    spans, end = {}, 0
    try:
        for name in names:
            t = header[name]
            dt = _TORCH[t["dtype"]]
            shape = [int(s) for s in t["shape"]]
            b, e = (int(x) for x in t["data_offsets"])
            if e - b != math.prod(shape) * dt.itemsize or b < 0:
                raise CorruptEntryError(f"tensor {name}: offsets do not match its shape")
            spans[name] = (dt, shape, b)
            end = max(end, e)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntryError(f"malformed tensor index ({type(e).__name__})") from None
    if end > data_len:
        raise CorruptEntryError(f"truncated: {data_len} data bytes, index needs {end}")
    if end < data_len:
        raise CorruptEntryError(f"{data_len - end} trailing bytes after the data")
    return spans, end


def decode(buf, key: str | None = None, fingerprint: str | None = None,
           compute_dtype: torch.dtype | None = None) -> ChunkKV:
    """Check and load one entry. `buf` should be writable (bytearray): float tensors are zero-copy views.

    Raises CorruptEntryError (truncated, bit flip, wrong key, foreign model fingerprint, bad layout).
    """
    header, data0 = parse_header(buf)
    meta = header["__metadata__"]
    if key is not None and meta.get("key") != key:
        raise CorruptEntryError(f"entry was written for key {str(meta.get('key'))[:16]}..., not this one")
    sd = meta.get("storage_dtype")
    if sd not in STORAGE_DTYPES:
        raise CorruptEntryError(f"unknown storage dtype {sd!r}")
    names = set(header) - {"__metadata__"}
    if names - {ANCHORS} != _expected_names(sd):
        raise CorruptEntryError(f"unexpected tensors {sorted(names)}")
    spans, end = _tensor_spans(header, names, len(buf) - data0)
    h = _hasher(meta.get("checksum_alg", ""))
    h.update(_canonical(header))
    h.update(memoryview(buf)[data0:data0 + end])
    if h.hexdigest() != meta.get("checksum"):
        raise CorruptEntryError("checksum mismatch (bit flip or partial write)")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise CorruptEntryError(f"foreign model: entry fingerprint {str(meta.get('fingerprint'))[:24]!r} "
                                f"!= expected {fingerprint[:24]!r}")

    def tensor(name):
        dt, shape, b = spans[name]
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt, count=n, offset=data0 + b).view(shape)

    if sd == "int8":
        out = compute_dtype or torch.float32
        keys = dequantize(tensor("keys.q"), tensor("keys.scale"), tensor("keys.zero"), out)
        values = dequantize(tensor("values.q"), tensor("values.scale"), tensor("values.zero"), out)
    else:
        keys, values = tensor("keys"), tensor("values")
        if compute_dtype is not None and compute_dtype != keys.dtype:
            keys, values = keys.to(compute_dtype), values.to(compute_dtype)
    anchors = tensor(ANCHORS) if ANCHORS in names else None
    if anchors is not None and anchors.dtype != torch.float32:
        raise CorruptEntryError(f"anchor scores stored as {anchors.dtype}, not float32")
    try:
        kv = ChunkKV(keys, values, tensor("token_ids"), int(meta["start"]), str(meta["fingerprint"]), anchors,
                     str(meta.get("anchor_tag", "")) if anchors is not None else "")
        if ",".join(map(str, kv.keys.shape)) != meta.get("shape") or str(kv.n_tokens) != meta.get("n_tokens"):
            raise ValueError("shape does not match the metadata")
    except (ValueError, KeyError) as e:
        raise CorruptEntryError(f"inconsistent entry: {e}") from None
    return kv


def entry_info(buf) -> dict:
    """Metadata of an entry from its header alone (for stats): no checksum, no tensors."""
    header, data0 = parse_header(buf)
    meta = header["__metadata__"]
    return {"key": meta.get("key"), "storage_dtype": meta.get("storage_dtype"),
            "n_tokens": int(meta.get("n_tokens", 0)), "fingerprint": meta.get("fingerprint"),
            "checksum_alg": meta.get("checksum_alg")}


def roundtrip(kv: ChunkKV, storage_dtype: str, compute_dtype: torch.dtype | None = None) -> ChunkKV:
    """What a store `get` returns for `kv` (for in-memory tiers), without serializing it."""
    if storage_dtype == "int8":
        out = compute_dtype or torch.float32
        kq, ks, kz = quantize_keys(kv.keys.detach())
        vq, vs, vz = quantize_values(kv.values.detach())
        keys, values = dequantize(kq, ks, kz, out), dequantize(vq, vs, vz, out)
    else:
        dt = STORAGE_DTYPES[storage_dtype]
        keys, values = kv.keys.detach().to(dt), kv.values.detach().to(dt)
        if not (_finite(keys) and _finite(values)):
            raise StoreError(f"chunk K/V is not finite in {storage_dtype} storage (overflow?); "
                             "use bfloat16 or float32 storage")
        if compute_dtype is not None:
            keys, values = keys.to(compute_dtype), values.to(compute_dtype)
    return ChunkKV(keys, values, kv.token_ids.to(torch.int64), int(kv.start), kv.fingerprint, kv.anchor_scores,
                   kv.anchor_tag)


def stored_nbytes(kv: ChunkKV, storage_dtype: str) -> int:
    """Bytes of the tensors of an entry (header excluded)."""
    L, H, n, d = kv.keys.shape
    anchors = 0 if kv.anchor_scores is None else 4 * L * n
    if storage_dtype == "int8":
        return 2 * L * H * n * d + 8 * L * H * (n + d) + 8 * n + anchors
    return 2 * L * H * n * d * STORAGE_DTYPES[storage_dtype].itemsize + 8 * n + anchors
