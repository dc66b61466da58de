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
#include <cmath>
#include <cstring>
#include <limits>
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
      for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(q_ptr[b * heads * dim + i]);
      scores.resize(heads * n);
      const int32_t* table = tables + b * table_width;
      // Pass 1: every K row once, the scores of all heads.
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        const float* k = as_float<T>(k_ptr + slot * kv_heads * dim, scratch.data(), kv_heads * dim);
        for (int64_t h = 0; h < heads; ++h) {
          scores[h * n + (j - first)] = dot(q.data() + h * dim, k + (h / group) * dim, dim) * fscale;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* sc = scores.data() + h * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = std::max(m, sc[j]);
        inv_sum[h] = 1.f / exp_shifted_sum(sc, m, n);
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
