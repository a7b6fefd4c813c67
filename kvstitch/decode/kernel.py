"""A fused CPU kernel for sparse paged attention: the selected pages are read in place from the host pool
(one pass over their K and V, online softmax), instead of gathered into a buffer and read again (#28).

The gather + two matmuls of `SparseDecoder._gather` / `grouped_attention` move every selected byte three
times (read, write the buffer, read it back) in a few dozen small ops per layer; at 8K tokens and a 1088-token
budget that is most of a sparse step's attention time on a CPU. The kernel reads each selected (page, KV head)
block once; several requests' layers run in one call, their (request, KV head) pairs spread over torch's
intra-op threads (`at::parallel_for`).

Built once per machine with `torch.utils.cpp_extension.load_inline` (a C++ compiler is needed; the build is
cached under torch's extensions directory). Without one, or with ``KVSTITCH_DECODE_KERNEL=0``, `available`
is False and the decoder keeps its torch path (the same pages, the same result to float rounding:
tests/test_decode_kernel.py compares them). CPU and float32 only; an accelerator uses the device pool path.
"""

from __future__ import annotations

import os
import threading

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <vector>

// exp(x) for the softmax's x <= 0: 2^n * 2^f with a degree-6 polynomial for 2^f (f in [-0.5, 0.5], relative
// error ~2e-7, as a float32 exp), written so that the compiler vectorizes the loops that call it.
static inline float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One (request, KV head): its G query rows over the M blocks in `ix`. DD > 0: the head size fixed at compile
// time (loops unrolled, the accumulators of a query row stay in registers); DD = 0: any head size.
template <int DD>
static void head_attention(const float* q, const float* K, const float* V, int64_t krs, int64_t vrs,
                           const int64_t* ix, int64_t M, int64_t P, int64_t Dr, int64_t G, int64_t last_len,
                           float scale, float* out, std::vector<float>& s) {
  const int64_t D = DD > 0 ? DD : Dr;
  s.resize(G * P);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float mx = -std::numeric_limits<float>::infinity(), l = 0.f;
    float acc[DD > 0 ? DD : 1024];
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    float* sg = s.data() + g * P;
    for (int64_t j = 0; j < M; ++j) {
      const int64_t len = (j == M - 1) ? last_len : P;
      const float* kp = K + ix[j] * krs;
      const float* vp = V + ix[j] * vrs;
      float bmx = mx;
      for (int64_t t = 0; t < len; ++t) {
        const float* kt = kp + t * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
        sg[t] = dot * scale;
        bmx = sg[t] > bmx ? sg[t] : bmx;
      }
      const float corr = exp_neg(mx - bmx);  // ~0 on the first block (mx = -inf; l and acc are 0 there)
      float sum = l * corr;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        sg[t] = exp_neg(sg[t] - bmx);
        sum += sg[t];
      }
      for (int64_t t = 0; t < len; ++t) {
        const float p = sg[t];
        const float* vt = vp + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * vt[d];
      }
      mx = bmx;
      l = sum;
    }
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[d] / l;
  }
}

// qs[b]: [Hq, D] float32 contiguous. ks[b] / vs[b]: [rows, P, D] float32 blocks (row stride free, tokens
// contiguous), row index[b][h, j] is the j-th attended block of KV head h. The last block of every head holds
// last_len[b] valid tokens (the partial last page), the others P. Query head hq uses KV head hq / G.
std::vector<torch::Tensor> paged_attention(std::vector<torch::Tensor> qs, std::vector<torch::Tensor> ks,
                                           std::vector<torch::Tensor> vs, std::vector<torch::Tensor> index,
                                           std::vector<int64_t> last_len, double scaling) {
  const int64_t B = qs.size();
  std::vector<torch::Tensor> outs(B);
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qs[b].is_contiguous() && qs[b].scalar_type() == torch::kFloat, "q must be contiguous float32");
    TORCH_CHECK(ks[b].stride(2) == 1 && ks[b].stride(1) == ks[b].size(2), "K blocks must be [rows, P, D] dense");
    TORCH_CHECK(vs[b].stride(2) == 1 && vs[b].stride(1) == vs[b].size(2), "V blocks must be [rows, P, D] dense");
    TORCH_CHECK(index[b].is_contiguous() && index[b].scalar_type() == torch::kLong, "index must be int64");
    TORCH_CHECK(qs[b].size(1) <= 1024, "head_dim above 1024");
    outs[b] = torch::empty_like(qs[b]);
    for (int64_t h = 0; h < index[b].size(0); ++h) items.emplace_back(b, h);
  }
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t start, int64_t end) {
    std::vector<float> s;
    for (int64_t it = start; it < end; ++it) {
      const int64_t b = items[it].first, h = items[it].second;
      const int64_t Hq = qs[b].size(0), D = qs[b].size(1), H = index[b].size(0), M = index[b].size(1);
      const int64_t G = Hq / H;
      const float* q = qs[b].data_ptr<float>() + h * G * D;
      const int64_t* ix = index[b].data_ptr<int64_t>() + h * M;
      float* out = outs[b].data_ptr<float>() + h * G * D;
      const float* K = ks[b].data_ptr<float>();
      const float* V = vs[b].data_ptr<float>();
      const int64_t krs = ks[b].stride(0), vrs = vs[b].stride(0), P = ks[b].size(1);
      if (D == 64)
        head_attention<64>(q, K, V, krs, vrs, ix, M, P, D, G, last_len[b], scale, out, s);
      else if (D == 128)
        head_attention<128>(q, K, V, krs, vrs, ix, M, P, D, G, last_len[b], scale, out, s);
      else
        head_attention<0>(q, K, V, krs, vrs, ix, M, P, D, G, last_len[b], scale, out, s);
    }
  });
  return outs;
}
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def _load():
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("KVSTITCH_DECODE_KERNEL", "1") == "0":
            _failed = "disabled by KVSTITCH_DECODE_KERNEL=0"
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline("kvstitch_paged_attention", cpp_sources=_SOURCE, functions=["paged_attention"],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler / headers: the torch path stays
            _failed = f"{type(e).__name__}: {e}"
        return _module


def available() -> bool:
    """True when the kernel is built (or can be built now) on this machine."""
    return _load() is not None


def why_unavailable() -> str | None:
    _load()
    return _failed


def paged_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
                    index: list[torch.Tensor], last_len: list[int], scaling: float) -> list[torch.Tensor]:
    """Attention of each ``qs[b] [Hq, D]`` over the blocks ``index[b] [Hkv, M]`` of ``ks[b]`` / ``vs[b]``
    (``[rows, P, D]``, the last block of each head ``last_len[b]`` tokens long) -> ``[Hq, D]`` each (float32)."""
    return _load().paged_attention(qs, ks, vs, index, last_len, float(scaling))
