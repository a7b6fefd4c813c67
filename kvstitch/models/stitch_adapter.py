"""The stitch adapter: a small learned component, one per model, that makes a stitched cache read like full
prefill. The base model's weights are never changed; the adapter attaches beside them.

Two parts, either or both (`StitchAdapterConfig`):

- **link tokens** (KVLink's idea, with the model frozen): ``links`` learned input embeddings that sit between
  the passages and the question (`PromptLayout.links`) and are always recomputed. They attend to every stitched
  passage, so their K/V carry cross-passage context the separately precomputed passages lack, and the question
  and the answer attend to them. Their ids are ``vocab + j`` (`LinkEmbedding` maps them to the learned rows).
- **a reader LoRA**: low-rank updates of the attention projections, applied only to the query-time tokens after the
  passages (link tokens, question, answer; in the recompute pass, the selection passes and decoding), never to
  recomputed passage tokens, at precompute or in full prefill. Which tokens read through it, and how strongly, is
  the *gate* (`gated`), set per forward from the caches (`StitchCache.reader_gate`).

How strongly depends on the recompute ratio (`StitchAdapter.strength_at`, measured after training by
`kvstitch.adapt.strength`): a partly fresh cache needs less correction than one nobody recomputed; 0 turns it off.

Both leave precompute untouched, so passage caches are shared with and without the adapter (same store key).
With the gate off and no link tokens in the prompt, the model computes exactly what it did before.

A third part changes precompute instead (SemPIC's idea): a **writer LoRA** (``writer`` > 0) applied only while
passages are precomputed (`writing`): free at query time, but its digest enters the store key
(`StitchAdapter.precompute_tag`), so caches written with and without it never mix. Both LoRAs adapt the attention
projections, or with ``targets`` the MLPs' too.

Files are safetensors with a JSON header naming the model (`weights_id`) they were trained for.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from kvstitch.core.errors import KVStitchError

FORMAT = "kvstitch-stitch-adapter"
VERSION = 1
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # more capacity: what the MLPs write moves every later layer
LORA_TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# None: no token reads through the reader LoRA; True: every token; a tensor broadcastable to the hidden
# states ([B, T, 1]): per token (a batch of requests with and without the adapter)
_GATE: contextvars.ContextVar = contextvars.ContextVar("kvstitch_stitch_gate", default=None)
# True while passages are precomputed by an engine whose adapter has a writer LoRA
_WRITING: contextvars.ContextVar = contextvars.ContextVar("kvstitch_stitch_writing", default=False)


class StitchAdapterError(KVStitchError):
    """An adapter file that is missing, unreadable, malformed or made for another model."""


@dataclass(frozen=True)
class StitchAdapterConfig:
    links: int = 8  # link tokens between the passages and the question (0: none)
    rank: int = 8  # reader LoRA rank (0: no LoRA)
    alpha: float = 16.0  # LoRA scale = alpha / rank
    targets: tuple[str, ...] = ATTENTION_TARGETS  # the projections the LoRAs adapt (`LORA_TARGETS`)
    writer: int = 0  # writer LoRA rank, applied at precompute (0: none; its caches get their own store key)

    def __post_init__(self):
        for name in ("links", "rank", "writer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"stitch adapter {name} must be an integer >= 0, got {v!r}")
        if self.links == 0 and self.rank == 0 and self.writer == 0:
            raise ValueError("a stitch adapter needs link tokens (links > 0), a reader LoRA (rank > 0), a writer "
                             "LoRA (writer > 0) or several")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad:
            raise ValueError(f"unknown LoRA target {bad[0]!r}; known: {', '.join(LORA_TARGETS)}")
        if (self.rank or self.writer) and not self.targets:
            raise ValueError("a stitch adapter with a LoRA adapts no projection: give it targets")

    @property
    def form(self) -> str:
        parts = ([f"links={self.links}"] if self.links else []) + ([f"lora(r={self.rank})"] if self.rank else []) \
            + ([f"writer(r={self.writer})"] if self.writer else [])
        return "+".join(parts)

    def identity(self) -> dict:
        """The fields that say what it computes (a writer-less config reads as it did before writers existed)."""
        d = asdict(self)
        if not self.writer:
            d.pop("writer")
        return d


@contextlib.contextmanager
def writing(on: bool = True):
    """Passages forwarded in this block write their K/V through the writer LoRA (when the adapter has one)."""
    token = _WRITING.set(on)
    try:
        yield
    finally:
        _WRITING.reset(token)


@contextlib.contextmanager
def gated(gate):
    """Tokens of the forwards in this block read through the reader LoRA where ``gate`` says (see `_GATE`)."""
    token = _GATE.set(gate)
    try:
        yield
    finally:
        _GATE.reset(token)


def gate_of(mask: torch.Tensor):
    """The gate of a forward from each token's LoRA strength, bool or float ([T] of one sequence, [B, 1] of a batched
    decode step, [Σ T_i] of a packed pass): None (no token reads through the LoRA), True (all, at full strength),
    else a float mask broadcastable to the hidden states."""
    mask = mask.float()
    if not bool((mask != 0).any()):
        return None
    if bool((mask == 1).all()):
        return True
    return mask.view(-1, 1, 1) if mask.dim() == 2 else mask.view(1, -1, 1)


class GatedLoRA(nn.Module):
    """``base(x) + gate · scale · B(A(x))`` (the reader), ``+ writer_scale · Bw(Aw(x))`` while `writing`; exactly
    ``base(x)`` when the gate is off and nothing is written."""

    def __init__(self, base: nn.Module, a: nn.Parameter | None, b: nn.Parameter | None, scale: float,
                 writer: tuple[nn.Parameter, nn.Parameter, float] | None = None):
        super().__init__()
        self.base, self.lora_a, self.lora_b, self.scale = base, a, b, scale
        self.writer_a, self.writer_b, self.writer_scale = writer if writer is not None else (None, None, 0.0)

    @property
    def weight(self):  # code that reads the projection's weight (dtype, device) sees the base's
        return self.base.weight

    def forward(self, x):
        out = self.base(x)
        if self.writer_a is not None and _WRITING.get():
            w = (x.to(self.writer_a.dtype) @ self.writer_a.t()) @ self.writer_b.t()
            out = out + (w * self.writer_scale).to(out.dtype)
        gate = _GATE.get()
        if gate is None or self.lora_a is None:
            return out
        delta = (x.to(self.lora_a.dtype) @ self.lora_a.t()) @ self.lora_b.t()
        delta = delta * self.scale
        if gate is not True:
            delta = delta * gate.to(delta.dtype)
        return out + delta.to(out.dtype)


class LinkEmbedding(nn.Module):
    """The model's input embedding, with ids ``>= vocab`` taken from the adapter's link rows."""

    def __init__(self, base: nn.Module, links: nn.Parameter):
        super().__init__()
        self.base, self.links = base, links
        self.vocab = base.weight.shape[0]

    @property
    def weight(self):
        return self.base.weight

    def forward(self, ids):
        is_link = ids >= self.vocab
        if not bool(is_link.any()):
            return self.base(ids)
        out = self.base(torch.where(is_link, torch.zeros_like(ids), ids))
        rows = self.links[(ids[is_link] - self.vocab)].to(out.dtype)
        return out.masked_scatter(is_link.unsqueeze(-1), rows)


class StitchAdapter(nn.Module):
    """The learned parameters (link embeddings, LoRA factors) and what they were trained for."""

    def __init__(self, config: StitchAdapterConfig, hidden: int, shapes: dict[str, tuple[int, int]],
                 weights_id: str, model_name: str | None = None, info: dict | None = None):
        """``shapes``: ``"<layer>.<target>" -> (in_features, out_features)`` of every projection the LoRA adapts."""
        super().__init__()
        self.config, self.hidden, self.weights_id = config, hidden, weights_id
        self.model_name = model_name or weights_id
        self.info = dict(info or {})  # how it was made: command, data, steps, CPU-hours (saved in the file)
        self.links = nn.Parameter(torch.zeros(config.links, hidden))
        self.lora_a, self.lora_b = nn.ParameterDict(), nn.ParameterDict()
        self.writer_a, self.writer_b = nn.ParameterDict(), nn.ParameterDict()
        for rank, da, db in ((config.rank, self.lora_a, self.lora_b), (config.writer, self.writer_a, self.writer_b)):
            for name, (n_in, n_out) in shapes.items() if rank else ():
                key = name.replace(".", "_")
                a = torch.empty(rank, n_in)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # LoRA's init: A random, B zero (starts as identity)
                da[key] = nn.Parameter(a)
                db[key] = nn.Parameter(torch.zeros(n_out, rank))
        self._attached: list[tuple[nn.Module, str, nn.Module]] = []

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model, weights_id: str, config: StitchAdapterConfig | None = None,
                  model_name: str | None = None) -> "StitchAdapter":
        """A fresh adapter for ``model``: link rows start at the mean input embedding (plus a little noise, so
        the rows differ), the LoRA as an identity (B = 0)."""
        config = config or StitchAdapterConfig()
        shapes = {name: (m.in_features, m.out_features) for name, m in _targets(model, config.targets)}
        emb = model.get_input_embeddings()
        hidden = emb.weight.shape[1]
        ad = cls(config, hidden, shapes, weights_id, model_name)
        with torch.no_grad():
            sample = emb(torch.arange(0, emb.weight.shape[0], max(1, emb.weight.shape[0] // 4096)))
            mean, std = sample.float().mean(0), sample.float().std(0)
            gen = torch.Generator().manual_seed(0)
            ad.links.copy_(mean + 0.1 * std * torch.randn(config.links, hidden, generator=gen))
        return ad

    # ---- attach to a model -------------------------------------------------------------------------
    def attach(self, model) -> None:
        """Wrap ``model``'s input embedding (link rows) and adapted projections (gated LoRA), in place."""
        if self._attached:
            raise RuntimeError("this stitch adapter is attached already")
        emb = model.get_input_embeddings()
        if emb.weight.shape[1] != self.hidden:
            raise StitchAdapterError(f"stitch adapter of hidden size {self.hidden} does not fit this model "
                                     f"(hidden size {emb.weight.shape[1]})")
        device, dtype = emb.weight.device, torch.float32
        self.to(device=device, dtype=dtype)
        if self.config.links:
            wrapper = LinkEmbedding(emb, self.links)
            model.set_input_embeddings(wrapper)
            self._attached.append((model, "__input_embeddings__", emb))
        c = self.config
        if c.rank or c.writer:
            for name, module in _targets(model, c.targets):
                key = name.replace(".", "_")
                if key not in (self.lora_a if c.rank else self.writer_a):
                    raise StitchAdapterError(f"stitch adapter has no LoRA for {name}: made for another model")
                reader = (self.lora_a[key], self.lora_b[key]) if c.rank else (None, None)
                writer = (self.writer_a[key], self.writer_b[key], c.alpha / c.writer) if c.writer else None
                parent, attr = _parent(model, module)
                setattr(parent, attr, GatedLoRA(module, *reader, c.alpha / max(c.rank, 1), writer))
                self._attached.append((parent, attr, module))

    def detach(self) -> None:
        """Put the model's own modules back."""
        for parent, attr, module in reversed(self._attached):
            if attr == "__input_embeddings__":
                parent.set_input_embeddings(module)
            else:
                setattr(parent, attr, module)
        self._attached = []

    @property
    def n_links(self) -> int:
        return self.config.links

    def link_ids(self, vocab: int) -> torch.Tensor:
        return torch.arange(vocab, vocab + self.config.links, dtype=torch.long)

    @property
    def schedule(self) -> list[tuple[float, float]]:
        """``(ratio, strength)`` points, ratios ascending (``info["strength"]``; none: full strength everywhere)."""
        return [(float(r), float(s)) for r, s in self.info.get("strength") or [(0.0, 1.0)]]

    def strength_at(self, ratio: float) -> float:
        """The reader LoRA's strength at recompute ``ratio``: the schedule, linear between its points and flat past
        its ends. 0: the adapter stays off (no link tokens, no LoRA)."""
        pts = self.schedule
        if ratio <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if ratio <= r1:  # (rounded: 0.1 -> 0.2 of 0.75 -> 0 is 0 at 0.2, not -1e-16)
                return round(min(1.0, max(0.0, s0 + (s1 - s0) * (ratio - r0) / (r1 - r0))), 9)
        return pts[-1][1]

    def digest(self) -> str:
        """sha256 of the parameters (what an evaluation run records: two adapters' rows never mix)."""
        h = hashlib.sha256(json.dumps(self.config.identity(), sort_keys=True).encode())
        if self.info.get("strength"):  # the schedule changes what it computes, too
            h.update(json.dumps(self.schedule).encode())
        for k, v in sorted(self.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def writes(self) -> bool:
        """It changes what precompute writes (a writer LoRA)."""
        return self.config.writer > 0

    def precompute_tag(self) -> str:
        """What enters the store key of passages it writes: a digest of the writer alone, so retraining the
        reader or the link tokens keeps the caches valid. Empty when it writes nothing."""
        if not self.writes:
            return ""
        params = [v for k, v in sorted(self.state_dict().items()) if k.startswith("writer_")]
        version = tuple(p._version for p in params)  # an optimizer step changes them in place
        if getattr(self, "_tag", (None, ""))[0] == version:
            return self._tag[1]
        h = hashlib.sha256(f"writer:{self.config.writer}:{self.config.alpha}".encode())
        for k, v in sorted(self.state_dict().items()):
            if k.startswith("writer_"):
                h.update(k.encode())
                h.update(v.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        self._tag = (version, "writer:" + h.hexdigest()[:16])
        return self._tag[1]

    @property
    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- files -------------------------------------------------------------------------------------
    def header(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "config": {**asdict(self.config),
                                                                  "targets": list(self.config.targets)},
                "hidden": self.hidden, "weights_id": self.weights_id, "model": self.model_name, "info": self.info}

    def save(self, path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        """Write the adapter (tensors in ``dtype``) through a temporary file and a rename."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"kvstitch": json.dumps(self.header())})
        tmp.chmod(0o644)  # safetensors writes owner-only files; an adapter is meant to be shared
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "StitchAdapter":
        """Read an adapter file; anything but a well-formed kvstitch adapter is one `StitchAdapterError`."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise StitchAdapterError(f"no stitch adapter file at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("kvstitch", "null"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as e:
            raise StitchAdapterError(f"{path} is not a readable stitch adapter file ({str(e)[:120]})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise StitchAdapterError(f"{path} is not a kvstitch stitch adapter (no '{FORMAT}' header)")
        if meta.get("version") != VERSION:
            raise StitchAdapterError(f"{path}: stitch adapter format version {meta.get('version')!r}, this "
                                     f"kvstitch reads version {VERSION}")
        try:
            c = meta["config"]
            config = StitchAdapterConfig(links=c["links"], rank=c["rank"], alpha=float(c["alpha"]),
                                         targets=tuple(c["targets"]), writer=int(c.get("writer", 0)))
            shapes = {}
            for k, a in tensors.items():
                for part in ("lora", "writer"):
                    if k.startswith(f"{part}_a."):
                        b = tensors[f"{part}_b." + k.removeprefix(f"{part}_a.")]
                        layer, target = k.removeprefix(f"{part}_a.").split("_", 1)
                        shapes[f"{layer}.{target}"] = (a.shape[1], b.shape[0])
            # the order `for_model` creates them in (layer, then target): an optimizer's state follows it
            order = sorted(shapes, key=lambda n: (int(n.split(".")[0]), config.targets.index(n.split(".")[1])))
            shapes = {n: shapes[n] for n in order}
            ad = cls(config, int(meta["hidden"]), shapes, str(meta["weights_id"]), meta.get("model"),
                     meta.get("info"))
            ad.load_state_dict(tensors, strict=True)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StitchAdapterError(f"{path}: malformed stitch adapter ({str(e).splitlines()[0][:160]})") from None
        return ad

    def check_model(self, weights_id: str, model_name: str | None = None) -> None:
        """Refuse to run on a model other than the one it was trained for."""
        if weights_id != self.weights_id:
            raise StitchAdapterError(f"stitch adapter was trained for {self.model_name} ({self.weights_id[:24]}), "
                                     f"this engine runs {model_name or weights_id} ({weights_id[:24]})")


def _targets(model, targets: tuple[str, ...]):
    """``("<layer>.<target>", module)`` of every adapted projection, from the decoder layers' attention and MLP."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        for t in targets:
            m = getattr(layer.mlp if t in MLP_TARGETS else layer.self_attn, t)
            if isinstance(m, GatedLoRA):
                m = m.base
            out.append((f"{i}.{t}", m))
    return out


def _decoder_layers(model):
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise StitchAdapterError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def _parent(model, module):
    for name, m in model.named_modules():
        for attr, child in m.named_children():
            if child is module:
                return m, attr
    raise RuntimeError("module not found in the model")


# the adapters kvstitch ships, one per embedded model (with the command and data that made each: <name>.json)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "adapters"
OFF = ("none", "off")  # what a command line or config says for "no adapter"
AUTO = "auto"  # the shipped adapter where its card says it measured better than none (`on_by_default`), else none


def shipped_adapters() -> list[str]:
    """The embedded models kvstitch ships a stitch adapter for."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.safetensors"))


def on_by_default(model: str) -> bool:
    """Whether the adapter kvstitch ships for the embedded model ``model`` is used when none is asked for (its
    card's ``on_by_default``: set where it measured better than no adapter on the report runs)."""
    card = SHIPPED_DIR / f"{model}.json"
    return card.is_file() and bool(json.loads(card.read_text(encoding="utf-8")).get("on_by_default", False))


def resolve_adapter(spec, model: str | None = None) -> "StitchAdapter | None":
    """``spec``: None / "none" (no adapter), "auto" (the shipped adapter where it is on by default: `on_by_default`,
    else none), "default" (the shipped adapter of the embedded model ``model``; None = the default model), a file
    path or a `StitchAdapter` -> the adapter (read, not yet checked against the model: `StitchAdapter.check_model`)."""
    from .loader import DEFAULT_MODEL

    if spec is None or isinstance(spec, StitchAdapter):
        return spec
    if not isinstance(spec, (str, Path)):
        raise StitchAdapterError(f"stitch_adapter must be None, 'auto', 'default', a file path or a StitchAdapter, "
                                 f"got {type(spec).__name__}")
    if str(spec).lower() in OFF:
        return None
    if spec == AUTO:
        return resolve_adapter("default", model) if on_by_default(model or DEFAULT_MODEL) else None
    if spec == "default":
        name = model or DEFAULT_MODEL
        path = SHIPPED_DIR / f"{name}.safetensors"
        if not path.is_file():
            ships = ", ".join(shipped_adapters()) or "none yet"
            raise StitchAdapterError(f"kvstitch ships no stitch adapter for {name} (it ships: {ships}); train one "
                                     f"with `kvstitch adapt --model {name}` and pass its file")
        return StitchAdapter.load(path)
    return StitchAdapter.load(Path(spec).expanduser())
