// specbatch::small_linear(x, weight, bias?, residual?): y = residual + x @ weight.T + bias for the
// few rows of a decode step, over a plain [N, K] weight (float32 or bfloat16).
//
// Why: oneDNN, through torch's mkldnn::_linear_pointwise, builds its primitive descriptor on
// every call: ~30 us at any size on this project's 2-core EPYC, against ~5 us for a plain
// F.linear. A decode step calls 4 linears per layer plus the head (121 calls for SmolLM2's 30
// layers), i.e. several ms of a ~17 ms bf16 step. vLLM's CPU build keeps its oneDNN primitive
// (and uses its own small-GEMM kernels) for the same reason. Decode GEMMs are bound by the
// weight bytes, so a plain register-tiled loop that streams each weight row once reaches the
// memory rate with a call cost of a few microseconds.
//
// Maths: every product is summed in float32 (bfloat16 inputs widened exactly), the bias added
// in float32, the result rounded once to the output dtype; with a residual, float32 adds it to
// the unrounded sum (oneDNN's fused add, bit for bit the two ops' result in float32) and
// bfloat16 adds it after rounding (two roundings, as the unfused eager ops). Each output's sum
// runs over k in the same order for any number of rows, so a row's result does not depend on
// the rows beside it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Loads Vec::size() weights as floats (bfloat16 widened exactly: a 16-bit shift).
inline Vec load_weights(const float* w) { return Vec::loadu(w); }
inline Vec load_weights(const c10::BFloat16* w) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
#else
  float buf[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) buf[i] = static_cast<float>(w[i]);
  return Vec::loadu(buf);
#endif
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// Weights are packed as [ceil(N / B), K, B] (B = Vec::size(): 16 floats with AVX-512, 8 with
// AVX2), the B outputs of a block side by side, so one vector load brings B outputs' weights
// for one k and a row's sums build up in vector lanes: no horizontal reduction per output.
constexpr int64_t B = Vec::size();

template <typename T>
struct Problem {
  const float* x;     // [M, K], widened to float32
  const T* w;         // packed [ceil(N / B), K, B]
  const T* bias;      // [N] or null
  const T* residual;  // [M, N] or null
  T* out;             // [M, N]
  int64_t M, N, K;
};

// Row m's sums for column block nb, written out with the bias and the residual (see the maths
// above); the padding columns of the last block are dropped.
template <typename T>
inline void write_out(const Problem<T>& p, int64_t m, int64_t nb, const Vec& acc) {
  alignas(64) float sums[B];
  acc.store(sums);
  const int64_t n_begin = nb * B, n_end = std::min<int64_t>(n_begin + B, p.N);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float s = sums[n - n_begin] + (p.bias ? widen(p.bias[n]) : 0.f);
    if constexpr (std::is_same_v<T, float>) {
      p.out[m * p.N + n] = p.residual ? p.residual[m * p.N + n] + s : s;
    } else {
      const T rounded = static_cast<T>(s);
      p.out[m * p.N + n] = p.residual ? static_cast<T>(widen(rounded) + widen(p.residual[m * p.N + n])) : rounded;
    }
  }
}

// Rows [m0, m0+MR) of x against column blocks [nb0, nb0+NB), written out with the bias and the
// residual (see the maths above).
template <typename T, int MR, int NB>
inline void tile(const Problem<T>& p, int64_t m0, int64_t nb0) {
  const int64_t K = p.K;
  Vec acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = Vec(0.f);
  const T* w0 = p.w + nb0 * K * B;
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_weights(w0 + (j * K + k) * B);
    for (int i = 0; i < MR; ++i) {
      const Vec xv(p.x[(m0 + i) * K + k]);
      for (int j = 0; j < NB; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) write_out(p, m0 + i, nb0 + j, acc[i][j]);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bfloat16 with AVX512_BF16: the packed layout interleaves k in pairs, [ceil(N / B), K2, B, 2]
// (K2 = ceil(K / 2)), and one vdpbf16ps adds a pair of products per lane: twice the work of a
// widening FMA per instruction. Each lane's sum still runs over k in order, for any row count.
#define SPECBATCH_DPBF16 1
constexpr bool kPairs = true;  // whether bfloat16 weights are packed in k pairs on this build

template <int MR, int NB>
inline void tile_pairs(const Problem<c10::BFloat16>& p, const c10::BFloat16* xb, int64_t K2, int64_t m0, int64_t nb0) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const c10::BFloat16* w0 = p.w + nb0 * K2 * B * 2;
  for (int64_t k = 0; k < K2; ++k) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w0 + (j * K2 + k) * B * 2);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, xb + (m0 + i) * K2 * 2 + 2 * k, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[j], (__m512bh)xv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) write_out(p, m0 + i, nb0 + j, Vec(acc[i][j]));
}
#else
constexpr bool kPairs = false;
#endif

#if defined(CPU_CAPABILITY_AVX512)
// 32 vector registers: 8 rows x 3 column blocks of accumulators, 3 weight vectors, 1 broadcast.
// A decode batch of up to 8 is one tile, so each weight streams from memory exactly once.
constexpr int kRows = 8;
constexpr int kBlocks = 3;
#else
// 16 vector registers (AVX2): 6 x 2 accumulators, 2 weight vectors, 1 broadcast.
constexpr int kRows = 6;
constexpr int kBlocks = 2;
#endif

// Every row tile of x against column blocks [nb0, nb0 + NB), the tile as the dtype's path runs it.
template <typename T, int NB, int MR>
inline void run_tile(const Problem<T>& p, const c10::BFloat16* xb, int64_t K2, int64_t m0, int64_t nb0) {
#ifdef SPECBATCH_DPBF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    tile_pairs<MR, NB>(p, xb, K2, m0, nb0);
    return;
  }
#endif
  tile<T, MR, NB>(p, m0, nb0);
}

template <typename T, int NB>
inline void rows_of(const Problem<T>& p, const c10::BFloat16* xb, int64_t K2, int64_t nb0) {
  int64_t m0 = 0;
  for (; m0 + kRows <= p.M; m0 += kRows) run_tile<T, NB, kRows>(p, xb, K2, m0, nb0);
  switch (p.M - m0) {
    case 7: run_tile<T, NB, 7>(p, xb, K2, m0, nb0); break;
    case 6: run_tile<T, NB, 6>(p, xb, K2, m0, nb0); break;
    case 5: run_tile<T, NB, 5>(p, xb, K2, m0, nb0); break;
    case 4: run_tile<T, NB, 4>(p, xb, K2, m0, nb0); break;
    case 3: run_tile<T, NB, 3>(p, xb, K2, m0, nb0); break;
    case 2: run_tile<T, NB, 2>(p, xb, K2, m0, nb0); break;
    case 1: run_tile<T, NB, 1>(p, xb, K2, m0, nb0); break;
    default: break;
  }
}

template <typename T>
void small_gemm(const at::Tensor& x2, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& residual2, at::Tensor& out2) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const bool pairs = std::is_same_v<T, c10::BFloat16> && kPairs;
  // The pair path reads x as bfloat16 pairs (K padded to even); the others read it widened.
  at::Tensor xf, xb;
  int64_t K2 = (K + 1) / 2;
  if (pairs) {
    xb = x2;
    if (K % 2) xb = at::constant_pad_nd(x2, {0, 1});
    xb = xb.contiguous();
  } else {
    xf = x2.scalar_type() == at::kFloat ? x2 : x2.to(at::kFloat);
  }
  const Problem<T> p{pairs ? nullptr : xf.data_ptr<float>(), packed.data_ptr<T>(),
                     bias.has_value() ? bias->data_ptr<T>() : nullptr,
                     residual2.has_value() ? residual2->data_ptr<T>() : nullptr, out2.data_ptr<T>(), M, N, K};
  const c10::BFloat16* xbp = pairs ? xb.data_ptr<c10::BFloat16>() : nullptr;
  const int64_t blocks = packed.size(0);
  const int64_t tasks = (blocks + kBlocks - 1) / kBlocks;
  // Grain: tasks of at least ~64 KB of weights (scheduling stays cheap next to the streaming).
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * kBlocks * B * (int64_t)sizeof(T)));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t nb0 = t * kBlocks;
      switch (std::min<int64_t>(kBlocks, blocks - nb0)) {
        case 3: rows_of<T, 3>(p, xbp, K2, nb0); break;
        case 2: rows_of<T, 2>(p, xbp, K2, nb0); break;
        default: rows_of<T, 1>(p, xbp, K2, nb0); break;
      }
    }
  });
}

// In-features of a packed weight: [blocks, K, B] or, bf16 in pairs, [blocks, K2, B, 2].
inline int64_t packed_rows(const at::Tensor& packed) {
  return packed.dim() == 4 ? 2 * packed.size(1) : packed.size(1);
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  const bool pairs = x.scalar_type() == at::kBFloat16 && kPairs;
  TORCH_CHECK(packed.dim() == (pairs ? 4 : 3) && packed.size(2) == B && packed.is_contiguous(),
              "small_linear: weight must be packed by pack_small_linear on this machine");
  const int64_t K = x.size(-1);
  TORCH_CHECK(pairs ? (K + 1) / 2 == packed.size(1) : K == packed.size(1), "small_linear: x has ", K,
              " features, the packed weight ", packed_rows(packed));
  TORCH_CHECK(out_features <= packed.size(0) * B && out_features > (packed.size(0) - 1) * B, "small_linear: bad out_features");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "small_linear: x and weight dtypes differ");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out_features &&
                                    bias->scalar_type() == packed.scalar_type()),
              "small_linear: bad bias");
  auto x2 = x.reshape({-1, K}).contiguous();
  auto out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  auto out2 = at::empty({x2.size(0), out_features}, x.options());
  std::optional<at::Tensor> residual2;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "small_linear: residual dtype differs");
    residual2 = residual->reshape({x2.size(0), out_features}).contiguous();
  }
  if (x.scalar_type() == at::kFloat) {
    small_gemm<float>(x2, packed, out_features, bias, residual2, out2);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "small_linear: float32 or bfloat16 only");
    small_gemm<c10::BFloat16>(x2, packed, out_features, bias, residual2, out2);
  }
  return out2.view(out_shape);
}

// The layout small_linear reads: [N, K] -> [ceil(N / B), K, B], or for bfloat16 with
// AVX512_BF16 [ceil(N / B), ceil(K / 2), B, 2]; padded with zeros.
at::Tensor pack_small_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_small_linear: weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + B - 1) / B;
  if (weight.scalar_type() == at::kBFloat16 && kPairs) {
    const int64_t K2 = (K + 1) / 2;
    auto padded = at::zeros({blocks * B, 2 * K2}, weight.options());
    padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
    return padded.view({blocks, B, K2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  auto padded = at::zeros({blocks * B, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({blocks, B, K}).permute({0, 2, 1}).contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specbatch, m) {
  m.def("small_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("pack_small_linear(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("pack_small_linear", &pack_small_linear);
}
