// CPU paged attention for decode steps and the KV-cache write, as torch.library ops
// (specbatch::paged_decode_attention, specbatch::write_kv), so that torch.compile keeps them
// as opaque calls in its graph and eager code can call them as well.
//
// Why: the torch reference gathers every sequence's blocks into a buffer and SDPA then reads
// that buffer again (at batch 64 attention was 39% of a step). Here each sequence reads its K
// rows once (scores), then its V rows once (weighted sum), straight from the cache blocks; the
// query heads that share a KV head (GQA) are served by the same reads.
// Semantics: those of specbatch_kernels.paged_attention.paged_attention_torch for a step whose
// sequences all have one query token (query of sequence b sits at position context_lens[b]-1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Vectorized with ATen's Vectorized<float> (AVX-512 or AVX2 as built, see cpu_ops.py).
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// acc[0:n] += p * v[0:n]
inline void axpy(float p, const float* v, float* acc, int64_t n) {
  const Vec pv(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(pv, Vec::loadu(v + d), Vec::loadu(acc + d)).store(acc + d);
  }
  for (; d < n; ++d) acc[d] += p * v[d];
}

template <typename T>
inline const float* as_float(const T* row, float* scratch, int64_t n) {
  for (int64_t d = 0; d < n; ++d) scratch[d] = static_cast<float>(row[d]);
  return scratch;
}

// bfloat16 -> float32 is a 16-bit shift (exact): vectorized, since a bf16 cache converts every
// K and V row it reads (done one element at a time, it was most of a bf16 decode's attention).
template <>
inline const float* as_float<c10::BFloat16>(const c10::BFloat16* row, float* scratch, int64_t n) {
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; d + 16 <= n; d += 16) {
    __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
    _mm512_storeu_ps(scratch + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; d + 8 <= n; d += 8) {
    __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    _mm256_storeu_ps(scratch + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; d < n; ++d) scratch[d] = static_cast<float>(row[d]);
  return scratch;
}

// x[0:n] = exp(x[0:n] - m), returning their sum (vectorized: Sleef's exp through ATen).
inline float exp_shifted_sum(float* x, float m, int64_t n) {
  const Vec mv(m);
  Vec total(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(x + j) - mv).exp();
    e.store(x + j);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

// Softmax over a row of n scores, unnormalized: x[j] = exp(x[j] - max), returning 1 / their sum.
inline float softmax_numerators(float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return 1.f / exp_shifted_sum(x, m, n);
}

template <>
inline const float* as_float<float>(const float* row, float*, int64_t) {
  return row;
}

// acc[h] = sum over rows j of p[h][j] * v_j (of h's KV head), j ascending: the same FMAs, in the
// same order, as one axpy per row, with the head's accumulator held in VECS registers.
template <int VECS>
inline void weighted_sums(const float* p, const float* const* vrows, int64_t n, int64_t heads, int64_t group,
                          int64_t dim, float* acc) {
  for (int64_t h = 0; h < heads; ++h) {
    Vec a[VECS];
    for (int t = 0; t < VECS; ++t) a[t] = Vec(0.f);
    const float* ph = p + h * n;
    const int64_t offset = (h / group) * dim;
    for (int64_t j = 0; j < n; ++j) {
      const Vec pj(ph[j]);
      const float* v = vrows[j] + offset;
      for (int t = 0; t < VECS; ++t) a[t] = at::vec::fmadd(pj, Vec::loadu(v + t * Vec::size()), a[t]);
    }
    for (int t = 0; t < VECS; ++t) a[t].store(acc + h * dim + t * Vec::size());
  }
}


#if defined(CPU_CAPABILITY_AVX512)
// The AVX-512 path: per sequence, 16 tokens at a time. Why: the generic loop above spent ~550
// cycles a token and layer (SmolLM2, bf16) on a horizontal reduction per token and head, K and
// V widened through a buffer; at batch 64 attention took 23 ms of an 83 ms step, 6 GB/s of KV.
// Here a token's score for a head is a 16-lane partial vector (two vdpbf16ps for a bf16 row of
// 64, no widening; FMAs in float32), and 16 tokens' partials are summed at once by a
// transposing add tree (45 instructions for 16 scores); the weighted sum keeps the heads of a
// KV group in registers, so each V row is loaded and widened once. The weighted sum is the
// generic loop's, bit for bit (each lane over the tokens in order); the scores are summed in
// another order (each exact product the same).

// Prefetches the bytes [p, p + bytes) into L2 (the next tokens' rows: blocks sit anywhere in the
// cache, so the hardware prefetcher loses the stream at every block). Into L2, not L1: at batch
// 64 that was 1.5x faster, an L1 prefetch no faster than none.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// r[t] = the sum of v[t]'s 16 lanes, for t < 16.
inline __m512 sum16(const __m512* v) {
  __m512 s2[8], s4[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane L: the sums over L of v[4i .. 4i+3]
    s4[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 floats of a row (bfloat16 widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The 16 lanes whose sum is q . k over a head of DV * 16 dims.
template <typename T, int DV>
inline __m512 partial_dot(const T* q, const T* k) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && DV % 2 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < DV / 2; ++d) {
      const __m512i kv = _mm512_loadu_si512(k + 32 * d), qv = _mm512_loadu_si512(q + 32 * d);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)kv, (__m512bh)qv);
    }
    return acc;
  }
#endif
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(load16(q + 16 * d), load16(k + 16 * d), acc);
  return acc;
}

// The weighted sums of H heads (of one KV group, consecutive from h0) over n V rows; the
// rows' bytes [prefetch_from, prefetch_from + prefetch_bytes) are prefetched 32 tokens ahead.
template <typename T, int DV, int H>
inline void weighted_heads(const float* scores, int64_t n, const T* const* vrows, int64_t offset, int64_t h0,
                           const float* inv_sum, T* o, int64_t prefetch_from, int64_t prefetch_bytes) {
  __m512 acc[H][DV];
  for (int i = 0; i < H; ++i)
    for (int d = 0; d < DV; ++d) acc[i][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (j + 32 < n) prefetch(vrows[j + 32] + prefetch_from, prefetch_bytes);
    const T* v = vrows[j] + offset;
    __m512 vv[DV];
    for (int d = 0; d < DV; ++d) vv[d] = load16(v + 16 * d);
    for (int i = 0; i < H; ++i) {
      const __m512 p = _mm512_set1_ps(scores[(h0 + i) * n + j]);
      for (int d = 0; d < DV; ++d) acc[i][d] = _mm512_fmadd_ps(p, vv[d], acc[i][d]);
    }
  }
  for (int i = 0; i < H; ++i) {
    alignas(64) float out[DV * 16];
    const __m512 s = _mm512_set1_ps(inv_sum[h0 + i]);
    for (int d = 0; d < DV; ++d) _mm512_store_ps(out + 16 * d, _mm512_mul_ps(acc[i][d], s));
    T* dst = o + (h0 + i) * DV * 16;
    for (int d = 0; d < DV * 16; ++d) dst[d] = static_cast<T>(out[d]);
  }
}

// Heads [h0, h0 + count) of a KV group, at most HB (the accumulators' registers) at a time.
template <typename T, int DV, int HB>
inline void weighted_group(const float* scores, int64_t n, const T* const* vrows, int64_t offset, int64_t h0,
                           int64_t count, const float* inv_sum, T* o, int64_t prefetch_from, int64_t prefetch_bytes) {
  for (; count >= HB; count -= HB, h0 += HB)
    weighted_heads<T, DV, HB>(scores, n, vrows, offset, h0, inv_sum, o, prefetch_from, prefetch_bytes);
  if constexpr (HB > 1) {
    if (count > 0) weighted_group<T, DV, HB - 1>(scores, n, vrows, offset, h0, count, inv_sum, o, prefetch_from,
                                                 prefetch_bytes);
  }
}

// One sequence's attention for the query heads of KV heads [g0, g1) (see the comment above),
// heads of DV * 16 dims; rows[j] points at token first + j's K (or V) row of all KV heads. Each
// tile of 16 K rows serves every head of the range while it is in L1; the first KV head's V
// pass prefetches the whole range of each V row, so the others find it in L2.
template <typename T, int DV>
void attend_heads(const T* q, const T* const* krows, const T* const* vrows, int64_t n, int64_t g0, int64_t g1,
                  int64_t group, float scale, std::vector<float>& scores, std::vector<float>& inv_sum, T* o) {
  constexpr int64_t dim = DV * 16;
  constexpr int64_t ahead = 32;  // tokens prefetched ahead
  const int64_t h0 = g0 * group, nh = (g1 - g0) * group;
  const int64_t span_from = g0 * dim, span_bytes = (g1 - g0) * dim * static_cast<int64_t>(sizeof(T));
  scores.resize(nh * n);
  inv_sum.resize(nh);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < std::min(n, ahead); ++j) prefetch(krows[j] + span_from, span_bytes);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    for (int64_t j = j0 + ahead; j < std::min(n, j0 + ahead + 16); ++j) prefetch(krows[j] + span_from, span_bytes);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t i = 0; i < nh; ++i) {
      const T* qh = q + (h0 + i) * dim;
      const int64_t offset = ((h0 + i) / group) * dim;
      __m512 part[16];
      for (int t = 0; t < 16; ++t)
        part[t] = t < count ? partial_dot<T, DV>(qh, krows[j0 + t] + offset) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(scores.data() + i * n + j0, mask, _mm512_mul_ps(sum16(part), sv));
    }
  }
  for (int64_t j = 0; j < std::min(n, ahead); ++j) prefetch(vrows[j] + span_from, span_bytes);
  for (int64_t i = 0; i < nh; ++i) {
    inv_sum[i] = softmax_numerators(scores.data() + i * n, n);
  }
  constexpr int HB = 24 / DV;  // accumulator registers: HB heads x DV vectors
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t first = (g - g0) * group;  // this KV head's query heads, in scores' rows
    weighted_group<T, DV, HB>(scores.data() + first * n, n, vrows, g * dim, 0, group, inv_sum.data() + first,
                              o + g * group * dim, g == g0 ? span_from : g * dim, g == g0 ? span_bytes : 0);
  }
}

// Work items: whole sequences where there are enough of them (each K and V row read in one
// pass), a sequence's KV heads apart otherwise (a batch of 1 uses both cores). Threads take
// items as they finish, longest contexts first: contexts differ, and static halves of the batch
// left one core waiting for the other at the end of every call.
template <typename T, int DV>
void decode_attention_avx512(const T* q_ptr, const T* k_ptr, const T* v_ptr, const int32_t* tables,
                             int64_t table_width, const int32_t* ctx_ptr, int64_t batch, int64_t heads,
                             int64_t kv_heads, int64_t block_size, float scale, int64_t sliding_window, T* o_ptr) {
  constexpr int64_t dim = DV * 16;
  const int64_t group = heads / kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = batch >= 4 * threads ? 1 : kv_heads;  // items per sequence
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ctx_ptr[a] > ctx_ptr[b]; });
  const int64_t total = batch * parts;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, total), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, inv_sum;
    std::vector<const T*> krows, vrows;
    int64_t rows_of = -1;  // the sequence whose row pointers krows/vrows hold
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      const int64_t b = order[item / parts];
      const int64_t g0 = parts == 1 ? 0 : item % parts, g1 = parts == 1 ? kv_heads : g0 + 1;
      const int64_t ctx = ctx_ptr[b];
      T* o = o_ptr + b * heads * dim;
      if (ctx <= 0) {  // a padding row: attends to nothing
        for (int64_t i = g0 * group * dim; i < g1 * group * dim; ++i) o[i] = static_cast<T>(0.f);
        continue;
      }
      // The query sits at position ctx - 1 and sees j > ctx - 1 - window.
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      const int64_t n = ctx - first;
      if (rows_of != b) {
        const int32_t* table = tables + b * table_width;
        krows.resize(n);
        vrows.resize(n);
        for (int64_t j = first; j < ctx; ++j) {
          const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
          krows[j - first] = k_ptr + slot * kv_heads * dim;
          vrows[j - first] = v_ptr + slot * kv_heads * dim;
        }
        rows_of = b;
      }
      attend_heads<T, DV>(q_ptr + b * heads * dim, krows.data(), vrows.data(), n, g0, g1, group, scale, scores,
                          inv_sum, o);
    }
  });
}
#endif

template <typename T>
void decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      int64_t sliding_window, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t table_width = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ctx_ptr = context_lens.data_ptr<int32_t>();
  T* o_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (dim == 64 || dim == 128) {
      (dim == 64 ? decode_attention_avx512<T, 4> : decode_attention_avx512<T, 8>)(
          q_ptr, k_ptr, v_ptr, tables, table_width, ctx_ptr, batch, heads, kv_heads, block_size, fscale,
          sliding_window, o_ptr);
      return;
    }
  }
#endif

  // One sequence per work item, all its heads at once: each token's K (then V) row of every KV
  // head is one contiguous read, block after block (prefetch-friendly); the query heads that
  // share a KV head (GQA) use the same row.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads * dim), acc(heads * dim), scratch(kv_heads * dim), scores, inv_sum(heads), vbuf;
    std::vector<const float*> vrows;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = ctx_ptr[b];
      T* o = o_ptr + b * heads * dim;
      if (ctx <= 0) {  // a padding row: attends to nothing
        for (int64_t i = 0; i < heads * dim; ++i) o[i] = static_cast<T>(0.f);
        continue;
      }
      // The query sits at position ctx - 1 and sees j > ctx - 1 - window.
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      const int64_t n = ctx - first;
      const int32_t* table = tables + b * table_width;
      for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(q_ptr[b * heads * dim + i]);
      scores.resize(heads * n);
      // Pass 1: every K row once, the scores of all heads.
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        const float* k = as_float<T>(k_ptr + slot * kv_heads * dim, scratch.data(), kv_heads * dim);
        for (int64_t h = 0; h < heads; ++h) {
          scores[h * n + (j - first)] = dot(q.data() + h * dim, k + (h / group) * dim, dim) * fscale;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        inv_sum[h] = softmax_numerators(scores.data() + h * n, n);
      }
      // Pass 2: every V row as floats once (float32 read in place, bfloat16 widened into a
      // buffer), then each head's weighted sum over the rows, in registers where the head fits.
      vrows.resize(n);
      if (!std::is_same_v<T, float>) vbuf.resize(n * kv_heads * dim);
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        float* widened = vbuf.empty() ? scratch.data() : vbuf.data() + (j - first) * kv_heads * dim;  // bf16 only
        vrows[j - first] = as_float<T>(v_ptr + slot * kv_heads * dim, widened, kv_heads * dim);
      }
      switch (dim % Vec::size() == 0 ? dim / Vec::size() : 0) {
        case 4: weighted_sums<4>(scores.data(), vrows.data(), n, heads, group, dim, acc.data()); break;
        case 8: weighted_sums<8>(scores.data(), vrows.data(), n, heads, group, dim, acc.data()); break;
        default:
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t h = 0; h < heads; ++h) {
              axpy(scores[h * n + j], vrows[j] + (h / group) * dim, acc.data() + h * dim, dim);
            }
          }
      }
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = static_cast<T>(acc[h * dim + d] * inv_sum[h]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "head_dim differs between query and cache");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.size(0) >= query.size(0) && context_lens.size(0) >= query.size(0),
              "one block-table row and context length per query row");
  auto q = query.contiguous();
  auto tables = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(q, k_cache, v_cache, tables, ctx, scale, sliding_window, out);
  });
  return out;
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  auto k = key.to(k_cache.scalar_type()).contiguous();
  auto v = value.to(v_cache.scalar_type()).contiguous();
  auto slots = slot_mapping.contiguous();
  TORCH_CHECK(k.numel() == slots.numel() * row && v.numel() == k.numel(), "key/value rows and slots differ");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t itemsize = k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < slots.numel(); ++t) {
    if (s[t] < 0) continue;  // padding
    TORCH_CHECK(s[t] < slots_total, "slot out of range");
    std::memcpy(kc + s[t] * row * itemsize, kp + t * row * itemsize, row * itemsize);
    std::memcpy(vc + s[t] * row * itemsize, vp + t * row * itemsize, row * itemsize);
  }
}

}  // namespace

TORCH_LIBRARY(specbatch, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int sliding_window) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
