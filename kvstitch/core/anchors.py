"""QCFuse's anchor pass: which tokens of a chunk a "repeat the previous context" prompt attends to most.

Re-implemented from QCFuse's public code (github.com/uYanJX/QCFuse, Apache-2.0; read in the
leideng/QCFuse copy): `blend/sglang_blend_ssd.py` appends ``DIGEST_ZIP_PROMPT`` = "\\n\\nRepeat the previous
context exactly." to every passage of the offline pass (`_build_augmented_prompt`), and
`srt/utils/digest_index_manager.py:DigestIndexManager.accumulate_kvzip_layer_score` scores each passage
token, at every layer below the highest critical layer, by the softmax attention the appended prompt's
tokens give it over the keys [first ``context_n_sink`` (4) tokens of the system prompt, the passage, the
prompt (causal)], reduced by the maximum over query heads and prompt tokens (``score_reduce =
"max_head_query"``). The ranking into anchors (first 4 tokens, then by score) happens at query time
(`kvstitch.select.qcfuse`), so the store keeps the scores of every layer and any ratio or set of critical
layers can use them.

Here the pass runs the prompt's tokens alone over the chunk's own stored cache (the shared prefix, then
the chunk at its precompute positions): causal attention makes that the same computation as encoding the
chunk with the prompt appended, while the chunk's K/V stay exactly what every other method stores and
loads. Scores come from the stored (storage-dtype) K/V, so a chunk's anchors are the same whether they were
computed when it was precomputed or later on demand. Cost: |prompt| tokens (10 on SmolLM2's tokenizer)
through every layer over one chunk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvstitch.core.attention import ForwardPlan
from kvstitch.core.cache import StitchCache
from kvstitch.core.chunk import ChunkKV
from kvstitch.core.errors import InputError

# blend/sglang_blend_ssd.py: DIGEST_ZIP_PROMPT
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
# blend/qcfuse_config.py: DEFAULT_CONTEXT_N_SINK
DEFAULT_SINKS = 4


@dataclass(frozen=True)
class AnchorSpec:
    """Which anchor pass a chunk needs: the appended prompt and the number of sink tokens (the first
    ``n_sink`` prefix tokens join the scoring softmax; the first ``n_sink`` chunk tokens are always anchors)."""

    prompt: str = REPEAT_PROMPT
    n_sink: int = DEFAULT_SINKS

    def __post_init__(self):
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise InputError("the anchor prompt is empty")
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise InputError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")

    def ids(self, tokenizer) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(self.prompt, add_special_tokens=False), dtype=torch.long)

    def tag(self, tokenizer) -> str:
        """The pass's name in the store: the prompt's token ids (hashed) and the sinks."""
        digest = hashlib.sha256(self.ids(tokenizer).numpy().tobytes()).hexdigest()[:16]
        return f"repeat-max:{digest}:sinks{self.n_sink}"


@torch.no_grad()
def anchor_scores(engine, prefix_ids: torch.Tensor, kv: ChunkKV, spec: AnchorSpec) -> torch.Tensor:
    """[L, n] float32 (cpu): per layer, the maximum over query heads and prompt tokens of the attention the
    prompt gives each chunk token, the softmax taken over the first ``n_sink`` prefix tokens, the chunk
    and the prompt (`accumulate_kvzip_layer_score`'s keys)."""
    prompt = spec.ids(engine.tokenizer)
    p, n, m = int(kv.start), kv.n_tokens, prompt.numel()
    L = engine.adapter.num_layers
    if p:
        pk, pv = engine.prefix_kv(prefix_ids)
        if pk.shape[2] != p:
            raise InputError(f"the chunk was computed after {p} prefix tokens, the prefix has {pk.shape[2]}")
    else:  # isolated precompute: no prefix, so no prefix sinks either
        pk = pv = kv.keys[:, :, :0].to(engine.device, engine.dtype)
    keys, values = kv.keys.to(engine.device, engine.dtype), kv.values.to(engine.device, engine.dtype)
    cache = StitchCache.from_stacked(torch.cat([pk, keys], 2), torch.cat([pv, values], 2), capacity=p + n + m)
    cols = torch.cat([torch.arange(min(spec.n_sink, p)), torch.arange(p, p + n + m)]).to(engine.device)
    s0 = min(spec.n_sink, p)  # where the chunk starts among the kept columns
    out = torch.zeros(L, n, dtype=torch.float32)

    def hook(layer: int, probs: torch.Tensor, values_: torch.Tensor) -> None:
        sub = probs[:, :, cols]  # [Hq, m, sinks + n + m]
        sub = sub / sub.sum(-1, keepdim=True).clamp_min(torch.finfo(sub.dtype).tiny)
        out[layer] = sub[:, :, s0:s0 + n].amax(dim=(0, 1)).cpu()

    engine.forward(cache, prompt, torch.arange(p + n, p + n + m), ForwardPlan(attn_hook=hook, stop_after_layer=L - 1))
    return out
