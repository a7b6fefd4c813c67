"""Architecture adapters: the one place that knows how a model family lays out layers, RoPE and windows.

The rest of kvstitch asks an adapter for: layer count, head counts (GQA groups), per-layer type
(full / sliding), per-layer sliding window, per-layer RoPE inverse frequencies (as the model itself
uses them) and the maximum position. Nothing else checks ``model_type``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from kvstitch.core.errors import ModelLoadError

# RoPE variants whose angle is a fixed linear function of position (rotation by a delta is exact).
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


@dataclass
class ModelAdapter:
    model: torch.nn.Module
    family: str

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def backbone(self):
        return self.model.model

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_q_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_q_heads

    @property
    def kv_groups(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    # ---- layer types / windows ----------------------------------------------------------------
    def layer_type(self, layer: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[layer] if types else "full_attention"

    def sliding_window(self, layer: int) -> int | None:
        return self.config.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    # ---- RoPE ---------------------------------------------------------------------------------
    def rope_parameters(self, layer: int) -> dict:
        rp = getattr(self.config, "rope_parameters", None) or {"rope_type": "default"}
        if self.layer_type(layer) in rp and isinstance(rp[self.layer_type(layer)], dict):
            rp = rp[self.layer_type(layer)]
        return rp

    def rope_type(self, layer: int) -> str:
        return self.rope_parameters(layer).get("rope_type", "default")

    def inv_freq(self, layer: int) -> torch.Tensor:
        """The inverse frequencies the model's rotary module really uses for this layer (float64 copy)."""
        rot = self.backbone.rotary_emb
        name = f"{self.layer_type(layer)}_inv_freq"
        f = getattr(rot, name, None)
        if f is None:
            f = rot.inv_freq
        return f.detach().to(torch.float64)

    def check_supported(self) -> None:
        for layer in range(self.num_layers):
            rt = self.rope_type(layer)
            if rt not in STATIC_ROPE_TYPES:
                raise ModelLoadError(
                    f"RoPE type {rt!r} (layer {layer}) depends on sequence length; position recovery supports "
                    f"{sorted(STATIC_ROPE_TYPES)}")
        if self.inv_freq(0).numel() * 2 != self.head_dim:
            raise ModelLoadError("partial rotary embeddings are not supported yet")

    def describe(self) -> dict:
        return {
            "family": self.family, "layers": self.num_layers, "q_heads": self.num_q_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "max_positions": self.max_positions,
            "layer_types": sorted({self.layer_type(i) for i in range(self.num_layers)}),
            "rope": sorted({f"{self.rope_type(i)}@{self.rope_parameters(i).get('rope_theta')}"
                            for i in range(self.num_layers)}),
        }


@dataclass
class MistralAdapter(ModelAdapter):
    # Mistral applies `config.sliding_window` (possibly None) on every layer and has no layer_types.
    def sliding_window(self, layer: int) -> int | None:
        return self.config.sliding_window


# model_type -> adapter class. Llama-like families need nothing beyond the generic config reading.
ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": ModelAdapter,
    "qwen2": ModelAdapter,    # use_sliding_window/max_window_layers are folded into config.layer_types
    "qwen3": ModelAdapter,    # q/k RMSNorm happens inside the model's own attention module
    "mistral": MistralAdapter,
    "gemma3_text": ModelAdapter,  # sliding + global layers, one RoPE base per layer type
    "gemma3": ModelAdapter,
}


@functools.cache
def _cache_keyword(model_cls: type) -> str:
    # transformers 5.x renamed forward's `past_key_values` to `cache`: the old name warns on every call and is
    # removed at 5.40, while the releases before the rename (>= 5.0 is allowed) only know the old one.
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model(...)``, under the KV-cache keyword this transformers release takes."""
    return {_cache_keyword(type(model)): cache}


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    mt = model.config.model_type
    if mt not in ADAPTERS:
        raise ModelLoadError(f"unsupported architecture {mt!r}; supported: {', '.join(sorted(ADAPTERS))}")
    ad = ADAPTERS[mt](model=model, family=mt)
    ad.check_supported()
    return ad
