// GQA paged decode attention on the CPU, reading K and V where they lie in the block pool (no gathered copy).
// One task per (sequence, kv head): the scores of its query-head group over the sequence's tokens, block by block
// through its block table, a softmax in float32, then the weighted sum of the values. The same contract as
// paged_kernels.paged_attention_decode: query [num_seqs, num_q_heads, head_dim], caches
// [num_blocks, num_kv_heads, block_size, head_dim], block_tables [num_seqs, max_blocks] (int64), seq_lens [num_seqs]
// (int64), out like query.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

// A register of LANES floats (GCC/Clang vector extensions: AVX-512 registers under -march=native where the CPU has
// them, pairs or quads of narrower ones elsewhere); load/store take unaligned addresses.
constexpr int64_t LANES = 16;
typedef float Vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float UnalignedVec __attribute__((vector_size(LANES * sizeof(float)), aligned(alignof(float))));
static inline Vec load(const float* at) { return *reinterpret_cast<const UnalignedVec*>(at); }
static inline void store(float* at, Vec v) { *reinterpret_cast<UnalignedVec*>(at) = v; }
// A loaded vector kept in a register: GCC otherwise folds the load into each multiply-add that reads it, one load
// per use, and the kernels' inner loops become bound by loads rather than multiply-adds.
static inline void in_register(Vec& v) {
#if defined(__AVX512F__) && defined(__GNUC__)  // a Vec is one register only with AVX-512
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

typedef int IVec __attribute__((vector_size(LANES * sizeof(int))));

// e^x for x <= 0 (a score minus its row's maximum), inline: e^x = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 in
// two parts (|r| <= ln 2 / 2), e^r by its Taylor polynomial of degree 7 (error below 1e-8 relative), 2^n by
// scalef. Within 2 ulp of expf; a call into glibc's vector expf instead spills every live register around it.
static inline Vec exp_nonpositive(Vec x) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_max_ps(reinterpret_cast<__m512>(x), _mm512_set1_ps(-104.0f));  // e^-104: 0 in float
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);  // ln 2's leading bits: n * them is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return reinterpret_cast<Vec>(_mm512_scalef_ps(p, n));
#else
  for (int64_t l = 0; l < LANES; ++l) x[l] = std::exp(x[l]);
  return x;
#endif
}

// A cache element as a float: the model's dtype converted, or (FP8 caches: uint8 codes) its value times the cache's
// scale (k_scale or v_scale), dequantized on load. ``rows`` converts n elements at once.
template <typename cache_t>
struct Dequant {
  static Dequant of(const float*) { return {}; }
  inline float operator()(cache_t x) const { return static_cast<float>(x); }
  inline void rows(float* dst, const cache_t* src, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
};

// FP8 codes: the 256-entry table (each code's value times the scale, paged_kernels.torch_backend's
// dequantization_table) defines the result. With AVX-512, sixteen codes at a time go through float16 instead: an
// e5m2 code is a float16's high byte, an e4m3 code's exponent and mantissa shifted into a float16's fields is its
// value times 2^-8 (subnormals included: the float16 conversion keeps them); the float32 product with 2^8 * scale is
// one rounding of the exact product, as the table's; e4m3's NaN codes are set as bits. ``of`` checks the 256 results
// against the table, bit for bit, and keeps to the table where any differs (e4m3's factor overflowing float32).
template <>
struct Dequant<uint8_t> {
  const float* lut;
  bool vector = false, e5m2 = false;
  float factor = 0.0f;

  static Dequant of(const float* lut) {
    Dequant d{lut};
#if defined(__AVX512F__)
    if (lut == nullptr) return d;
    d.e5m2 = (__builtin_bit_cast(uint32_t, lut[0x7C]) & 0x7FFFFFFFu) == 0x7F800000u;  // e4m3fn has no infinity
    const float scale = lut[d.e5m2 ? 0x3C : 0x38];  // the code of 1.0
    d.factor = d.e5m2 ? scale : std::ldexp(scale, 8);
    d.vector = d.matches_table();
#endif
    return d;
  }
#if defined(__AVX512F__)
  inline Vec convert16(const uint8_t* src) const {
    const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    __m256i half;
    if (e5m2) {
      half = _mm256_slli_epi16(codes, 8);
    } else {
      const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)), 8);
      half = _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x7F)), 7));
    }
    __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(factor));
    if (!e5m2) {  // S.1111.111 is NaN
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(codes, _mm256_set1_epi16(0x7F)),
                                                    _mm256_set1_epi16(0x7F));
      value = _mm512_mask_mov_ps(value, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
    }
    return reinterpret_cast<Vec>(value);
  }
  bool matches_table() const {  // bit for bit; any NaN matches any NaN
    alignas(64) uint8_t codes[256];
    alignas(64) float values[256];
    for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
    for (int c = 0; c < 256; c += LANES) store(values + c, convert16(codes + c));
    for (int c = 0; c < 256; ++c) {
      const uint32_t ours = __builtin_bit_cast(uint32_t, values[c]), theirs = __builtin_bit_cast(uint32_t, lut[c]);
      const bool both_nan = (ours & 0x7FFFFFFFu) > 0x7F800000u && (theirs & 0x7FFFFFFFu) > 0x7F800000u;
      if (ours != theirs && !both_nan) return false;
    }
    return true;
  }
#endif
  inline float operator()(uint8_t x) const { return lut[x]; }
  inline void rows(float* dst, const uint8_t* src, int64_t n) const {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (vector)
      for (; i + LANES <= n; i += LANES) store(dst + i, convert16(src + i));
#endif
    for (; i < n; ++i) dst[i] = lut[src[i]];
  }
};

// 16 vectors' lane sums at once: lane j of the result is the sum of p[j]'s lanes. A tree of pairwise shuffles and
// adds (4 levels, 30 shuffles for 16 sums) instead of a horizontal reduction per vector; the tree leaves the sums in
// bit-reversed order (lane of sum j: j's 4 bits reversed), which the last shuffle undoes.
static inline Vec lane_sums16(const Vec* p) {
  const IVec a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const IVec b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const IVec a2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const IVec b2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const IVec a3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const IVec b3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const IVec a4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const IVec b4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const IVec reverse = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  Vec l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)
    l1[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], a1) + __builtin_shuffle(p[2 * i], p[2 * i + 1], b1);
  for (int i = 0; i < 4; ++i)
    l2[i] = __builtin_shuffle(l1[2 * i], l1[2 * i + 1], a2) + __builtin_shuffle(l1[2 * i], l1[2 * i + 1], b2);
  for (int i = 0; i < 2; ++i)
    l3[i] = __builtin_shuffle(l2[2 * i], l2[2 * i + 1], a3) + __builtin_shuffle(l2[2 * i], l2[2 * i + 1], b3);
  const Vec sums = __builtin_shuffle(l3[0], l3[1], a4) + __builtin_shuffle(l3[0], l3[1], b4);
  return __builtin_shuffle(sums, reverse);
}

// The scores of up to 16 consecutive keys (rows of head_dim floats, head_dim a multiple of LANES) against a query
// row: lane j of each key's products, summed for all 16 at once (``lane_sums16``).
static inline Vec scores16(const float* query, const float* const* keys, int64_t count, int64_t head_dim) {
  Vec partial[16];
  for (int64_t j = 0; j < 16; ++j) {
    Vec acc = {0};
    if (j < count)
      for (int64_t c = 0; c < head_dim; c += LANES) acc += load(query + c) * load(keys[j] + c);
    partial[j] = acc;
  }
  return lane_sums16(partial);
}

// Rows of a kv head asked for ahead of use, into L2 (``elements`` of the cache's type): the blocks of a sequence lie
// anywhere in the pool and the hardware prefetcher does not follow a block table. Two blocks ahead into L2: one block
// ahead into L1, all at once, left the decode at a third of the memory's bandwidth (docs/benchmarks.md).
constexpr int64_t PREFETCH_BLOCKS = 2;
template <typename cache_t>
static inline void prefetch_rows(const cache_t* rows, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(rows);
  const int64_t size = elements * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t at = 0; at < size; at += 64) __builtin_prefetch(bytes + at, 0, 1);
}

// acc[0, head_dim) += sum over count rows of weights[t] * values[t] (rows of head_dim floats, head_dim a multiple of
// LANES up to MAX_REGISTER_DIM): the sums stay in registers for the block, two sets (even and odd rows) so that
// consecutive rows' multiply-adds do not wait for each other, instead of a load and a store of acc per row.
constexpr int64_t MAX_REGISTER_DIM = 128;
static inline void weigh_rows(float* acc, const float* weights, const float* values, int64_t count,
                              int64_t head_dim) {
  constexpr int64_t R = MAX_REGISTER_DIM / LANES;
  const int64_t chunks = head_dim / LANES;
  Vec even[R], odd[R];
  for (int64_t c = 0; c < chunks; ++c) {
    even[c] = load(acc + c * LANES);
    odd[c] = Vec{0};
  }
  int64_t t = 0;
  for (; t + 1 < count; t += 2) {
    const float p0 = weights[t], p1 = weights[t + 1];
    const float* r0 = values + t * head_dim;
    const float* r1 = r0 + head_dim;
    for (int64_t c = 0; c < chunks; ++c) {
      even[c] += p0 * load(r0 + c * LANES);
      odd[c] += p1 * load(r1 + c * LANES);
    }
  }
  if (t < count) {
    const float p0 = weights[t];
    const float* r0 = values + t * head_dim;
    for (int64_t c = 0; c < chunks; ++c) even[c] += p0 * load(r0 + c * LANES);
  }
  for (int64_t c = 0; c < chunks; ++c) store(acc + c * LANES, even[c] + odd[c]);
}

template <typename scalar_t, typename cache_t>
static void decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                   const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale, const float* k_lut, const float* v_lut) {
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* q_base = query.data_ptr<scalar_t>();
  const cache_t* k_base = key_cache.data_ptr<cache_t>();
  const cache_t* v_base = value_cache.data_ptr<cache_t>();
  const Dequant<cache_t> k_load = Dequant<cache_t>::of(k_lut), v_load = Dequant<cache_t>::of(v_lut);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const int64_t block_stride = num_kv_heads * block_size * head_dim, head_stride = block_size * head_dim;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores, maxima(group), sums(group), row(head_dim),
        key_rows(16 * head_dim), value_rows(block_size * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = std::min<int64_t>(lens[seq], max_blocks * block_size);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_base + (seq * num_q_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (len <= 0) {
        for (int64_t g = 0; g < group; ++g) {
          scalar_t* dst = out_base + (seq * num_q_heads + kv_head * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(0.0f);
        }
        continue;
      }
      scores.resize(group * len);
      std::fill(maxima.begin(), maxima.end(), std::numeric_limits<float>::lowest());  // finite: built fast-math
      // each of the sequence's tokens t, with its row in ``cache`` (this kv head's), block by block
      const int64_t* table = tables + seq * max_blocks;
      auto block_rows = [&](const cache_t* cache, int64_t b) { return cache + table[b] * block_stride +
                                                                       kv_head * head_stride; };
      auto prefetch_ahead = [&](const cache_t* cache, int64_t first, int64_t last) {  // blocks [first, last)
        for (int64_t b = first; b < last && b * block_size < len; ++b) prefetch_rows(block_rows(cache, b), head_stride);
      };
      auto each_token = [&](const cache_t* cache, auto&& visit) {
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
          const cache_t* rows = cache + table[t0 / block_size] * block_stride + kv_head * head_stride;
          const int64_t count = std::min(block_size, len - t0);
          for (int64_t j = 0; j < count; ++j) visit(t0 + j, rows + j * head_dim);
        }
      };
      auto score = [&](int64_t t, const auto* key, auto load) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(key[d]);
          scores[g * len + t] = dot;
          maxima[g] = std::max(maxima[g], dot);
        }
      };
      auto weigh = [&](int64_t t, const auto* value, auto load) {
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * load(value[d]);
        }
      };
      // FP8 rows are dequantized once into a float row (one table lookup an element), which every query head of
      // the group then reads with vector loads; a lookup inside the group's loops would be repeated and scalar
      const auto as_is = [](float x) { return x; };
      if (head_dim % LANES == 0) {  // the scores, 16 keys at a time (``scores16``)
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
          const cache_t* rows = k_base + table[t0 / block_size] * block_stride + kv_head * head_stride;
          const int64_t in_block = std::min(block_size, len - t0);
          if (t0 == 0) prefetch_ahead(k_base, 1, PREFETCH_BLOCKS);  // the spread prefetch starts PREFETCH_BLOCKS on
          const int64_t ahead = t0 / block_size + PREFETCH_BLOCKS;
          const cache_t* later = ahead * block_size < len ? block_rows(k_base, ahead) : nullptr;
          for (int64_t j0 = 0; j0 < in_block; j0 += 16) {
            const int64_t count = std::min<int64_t>(16, in_block - j0);
            if (later) prefetch_rows(later + j0 * head_dim, std::min<int64_t>(16, block_size - j0) * head_dim);
            const float* keys[16];
            for (int64_t j = 0; j < count; ++j) {
              const cache_t* key = rows + (j0 + j) * head_dim;
              if constexpr (std::is_same<cache_t, float>::value) {
                keys[j] = key;
              } else {  // converted (or dequantized) once, for every query head of the group
                float* converted = key_rows.data() + j * head_dim;
                k_load.rows(converted, key, head_dim);
                keys[j] = converted;
              }
            }
            for (int64_t g = 0; g < group; ++g) {
              float sums_out[16];
              store(sums_out, scores16(q.data() + g * head_dim, keys, count, head_dim));
              float* dst = scores.data() + g * len + t0 + j0;
              float maximum = maxima[g];
              for (int64_t j = 0; j < count; ++j) {
                dst[j] = sums_out[j];
                maximum = std::max(maximum, sums_out[j]);
              }
              maxima[g] = maximum;
            }
          }
        }
      } else {
        each_token(k_base, [&](int64_t t, const cache_t* key) {  // the scores, a key at a time
          if constexpr (std::is_same<cache_t, uint8_t>::value) {
            for (int64_t d = 0; d < head_dim; ++d) row[d] = k_load(key[d]);
            score(t, row.data(), as_is);
          } else {
            score(t, key, k_load);
          }
        });
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax numerators and their sums
        float sum = 0.0f;
        float* row = scores.data() + g * len;
        const float maximum = maxima[g];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - maximum);  // vectorized (glibc's vector expf)
          sum += row[t];
        }
        sums[g] = sum;
      }
      if (head_dim % LANES == 0 && head_dim <= MAX_REGISTER_DIM) {  // the weighted values, in registers
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
          const cache_t* rows = v_base + table[t0 / block_size] * block_stride + kv_head * head_stride;
          const int64_t count = std::min(block_size, len - t0);
          if (t0 == 0) prefetch_ahead(v_base, 1, PREFETCH_BLOCKS);
          if (t0 + PREFETCH_BLOCKS * block_size < len)
            prefetch_rows(block_rows(v_base, t0 / block_size + PREFETCH_BLOCKS), head_stride);
          const float* values;
          if constexpr (std::is_same<cache_t, float>::value) {
            values = rows;
          } else {  // converted (or dequantized) once, for every query head of the group
            v_load.rows(value_rows.data(), rows, count * head_dim);
            values = value_rows.data();
          }
          for (int64_t g = 0; g < group; ++g)
            weigh_rows(acc.data() + g * head_dim, scores.data() + g * len + t0, values, count, head_dim);
        }
      } else {
        each_token(v_base, [&](int64_t t, const cache_t* value) {  // the weighted values, a row at a time
          if constexpr (std::is_same<cache_t, uint8_t>::value) {
            for (int64_t d = 0; d < head_dim; ++d) row[d] = v_load(value[d]);
            weigh(t, row.data(), as_is);
          } else {
            weigh(t, value, v_load);
          }
        });
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_base + (seq * num_q_heads + kv_head * group + g) * head_dim;
        const float inverse = 1.0f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inverse);
      }
    }
  });
}

// The 256-entry dequantization tables of an FP8 cache pair (empty tensors: the caches hold the query's dtype).
static void check_luts(const char* op, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                       const torch::Tensor& k_lut, const torch::Tensor& v_lut) {
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), op, ": key and value caches must share a dtype");
  if (key_cache.scalar_type() != at::kByte) return;
  TORCH_CHECK(k_lut.scalar_type() == at::kFloat && v_lut.scalar_type() == at::kFloat && k_lut.numel() == 256 &&
              v_lut.numel() == 256 && k_lut.is_contiguous() && v_lut.is_contiguous(),
              op, ": FP8 (uint8) caches need 256-entry contiguous float32 k_lut and v_lut");
}

void paged_attention_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                            double scale, torch::Tensor k_lut, torch::Tensor v_lut) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              out.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_attention_decode (cpu): tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention_decode (cpu): block_tables and seq_lens must be int64");
  TORCH_CHECK((query.scalar_type() == key_cache.scalar_type() || key_cache.scalar_type() == at::kByte) &&
              out.scalar_type() == query.scalar_type(),
              "paged_attention_decode (cpu): query, caches (unless FP8 codes, uint8) and out must share a dtype");
  check_luts("paged_attention_decode (cpu)", key_cache, value_cache, k_lut, v_lut);
  const bool fp8 = key_cache.scalar_type() == at::kByte;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_decode", [&] {
    if (fp8)
      decode<scalar_t, uint8_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                k_lut.data_ptr<float>(), v_lut.data_ptr<float>());
    else
      decode<scalar_t, scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, nullptr, nullptr);
  });
}

// Causal attention of prompt chunks over the paged cache, read in place (the chunk's own keys and values written there
// first): sequence s's queries are rows [query_start_loc[s], query_start_loc[s + 1]) of query [T, Hq, D]; its row i
// is the token at position context_lens[s] + i, which sees the sequence's tokens 0 .. that position through
// block_tables[s]. Tasks are (sequence, kv head, tile of TILE_TOKENS tokens): a tile's query-head group multiplies one
// tile of KEY_TILE keys at a time (copied out of their blocks once, keys transposed), with an online softmax in
// float32 (flash attention's). Tasks are dealt to the threads by their cost, largest first (a causal chunk's late
// tiles see more keys).
constexpr int64_t TILE_TOKENS = 128, KEY_TILE = 64, ROW_BLOCK = 4, D_CHUNK = 32;
constexpr float MASKED = -1e30f;  // finite: the file is built with -ffast-math
template <typename scalar_t, int64_t D, typename cache_t = scalar_t>
struct PrefillTask {
  static_assert(D % D_CHUNK == 0, "head sizes are multiples of D_CHUNK");
  const scalar_t* q;
  const cache_t *kc, *vc;
  Dequant<cache_t> k_load, v_load;
  scalar_t* out;
  const int64_t* table;
  int64_t q_heads, group, block_size, block_stride, head_stride;
  float scale;
  // bfloat16 queries and keys: the scores by AVX-512 BF16's dot products of pairs (exact products, float32 sums),
  // half the instructions of converting both to float32; the query is scaled after (its scores), not before
#if defined(__AVX512BF16__)
  static constexpr bool PAIRED = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;
#else
  static constexpr bool PAIRED = false;
#endif

  // tokens [t0, t0 + n) of query/out, the first at position first_pos, with kv head h. Rows are (token, q head of
  // the group), ROW_BLOCK at a time: a block's scores over the key tile and its weighted values are register tiles.
  void run(int64_t t0, int64_t n, int64_t first_pos, int64_t h, std::vector<float>& buffer) const {
    const int64_t rows = n * group, padded = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    const int64_t num_keys = first_pos + n;
    buffer.resize(padded * (2 * D + 1 + LANES) + 2 * KEY_TILE * D);
    float *qf = buffer.data(), *acc = qf + padded * D, *maxima = acc + padded * D, *sums = maxima + padded;
    float *keys_t = sums + padded * LANES, *values = keys_t + KEY_TILE * D;  // keys transposed [D][KEY_TILE]
    std::fill(qf, qf + padded * D, 0.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q + ((t0 + i) * q_heads + h * group + g) * D;
        float* row = qf + (i * group + g) * D;
        if constexpr (PAIRED)
          std::memcpy(row, src, D * sizeof(scalar_t));  // a row's D / 2 pairs of bfloat16
        else
          for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(src[d]) * scale;
      }
    std::fill(acc, acc + padded * D, 0.0f);
    std::fill(maxima, maxima + padded, MASKED);
    std::fill(sums, sums + padded * LANES, 0.0f);  // a row's sum in LANES parts, added up at the end
    for (int64_t k0 = 0; k0 < num_keys; k0 += KEY_TILE) {
      const int64_t count = std::min(KEY_TILE, num_keys - k0);
      load_keys(k0, count, h, keys_t, values);
      for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
        int64_t visible[ROW_BLOCK], most = 0;
        for (int64_t b = 0; b < ROW_BLOCK; ++b) {  // causal: a row sees the keys up to its token's position
          const int64_t r = r0 + b;
          visible[b] = r < rows ? std::max<int64_t>(0, std::min(count, first_pos + r / group - k0 + 1)) : 0;
          most = std::max(most, visible[b]);
        }
        if (most == 0) continue;
        alignas(64) float s[ROW_BLOCK][KEY_TILE];
        if constexpr (PAIRED)
          paired_scores(qf + r0 * D, keys_t, s, scale);
        else
          scores(qf + r0 * D, keys_t, s);
        float rescale[ROW_BLOCK];
        for (int64_t b = 0; b < ROW_BLOCK; ++b) rescale[b] = softmax_step(s[b], visible[b], maxima[r0 + b],
                                                                           sums + (r0 + b) * LANES);
        for (int64_t c = 0; c < D; c += D_CHUNK) weigh_values(s, values + c, most, rescale, acc + r0 * D + c);
      }
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        scalar_t* dst = out + ((t0 + i) * q_heads + h * group + g) * D;
        const Vec parts = load(sums + r * LANES);
        float sum = 0.0f;
        for (int64_t l = 0; l < LANES; ++l) sum += parts[l];
        const float inverse = 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * D + d] * inverse);
      }
  }

  // s[b][j] = q row b . key j for a block of ROW_BLOCK rows and the tile's KEY_TILE keys (keys_t: [D][KEY_TILE])
  static void scores(const float* qf, const float* keys_t, float (*s)[KEY_TILE]) {
    static_assert(KEY_TILE == 4 * LANES, "a key tile is four registers");
    Vec acc[ROW_BLOCK][4] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float* row = keys_t + d * KEY_TILE;
      Vec k0 = load(row), k1 = load(row + LANES), k2 = load(row + 2 * LANES), k3 = load(row + 3 * LANES);
      in_register(k0), in_register(k1), in_register(k2), in_register(k3);
      for (int64_t b = 0; b < ROW_BLOCK; ++b) {
        const float qd = qf[b * D + d];
        acc[b][0] += qd * k0, acc[b][1] += qd * k1, acc[b][2] += qd * k2, acc[b][3] += qd * k3;
      }
    }
    for (int64_t b = 0; b < ROW_BLOCK; ++b)
      for (int64_t x = 0; x < 4; ++x) store(s[b] + x * LANES, acc[b][x]);
  }

  // ``scores`` for bfloat16: q rows hold D / 2 pairs (row stride D floats), keys_t [D / 2][KEY_TILE] pairs; scaled
  static void paired_scores(const float* qf, const float* keys_t, float (*s)[KEY_TILE], float scale) {
#if defined(__AVX512BF16__)
    __m512 acc[ROW_BLOCK][4];
    for (int64_t b = 0; b < ROW_BLOCK; ++b)
      for (int64_t x = 0; x < 4; ++x) acc[b][x] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D / 2; ++d) {
      const float* row = keys_t + d * KEY_TILE;
      __m512bh k[4];
      for (int64_t x = 0; x < 4; ++x) k[x] = reinterpret_cast<__m512bh>(_mm512_loadu_ps(row + x * LANES));
      for (int64_t b = 0; b < ROW_BLOCK; ++b) {
        uint32_t bits;  // the pair's 32 bits as they are (read as a float, a NaN pattern could be changed)
        std::memcpy(&bits, qf + b * D + d, sizeof(bits));
        const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(bits)));
        for (int64_t x = 0; x < 4; ++x) acc[b][x] = _mm512_dpbf16_ps(acc[b][x], pair, k[x]);
      }
    }
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < ROW_BLOCK; ++b)
      for (int64_t x = 0; x < 4; ++x) _mm512_store_ps(s[b] + x * LANES, _mm512_mul_ps(acc[b][x], factor));
#else
    (void)qf, (void)keys_t, (void)s, (void)scale;
#endif
  }

  // acc rows (D_CHUNK of their columns, row stride D) = acc * rescale + p . values over the tile's first ``keys``
  static void weigh_values(const float (*p)[KEY_TILE], const float* values, int64_t keys, const float* rescale,
                           float* acc) {
    static_assert(D_CHUNK == 2 * LANES, "a chunk of the head is two registers");
    Vec a[ROW_BLOCK][2];
    for (int64_t b = 0; b < ROW_BLOCK; ++b)
      for (int64_t x = 0; x < 2; ++x) a[b][x] = load(acc + b * D + x * LANES) * rescale[b];
    for (int64_t j = 0; j < keys; ++j) {
      Vec v0 = load(values + j * D), v1 = load(values + j * D + LANES);
      in_register(v0), in_register(v1);
      for (int64_t b = 0; b < ROW_BLOCK; ++b) a[b][0] += p[b][j] * v0, a[b][1] += p[b][j] * v1;
    }
    for (int64_t b = 0; b < ROW_BLOCK; ++b)
      for (int64_t x = 0; x < 2; ++x) store(acc + b * D + x * LANES, a[b][x]);
  }

  // keys k0 .. k0 + count - 1 of kv head h out of their blocks, in float: keys transposed, values as rows; zeros past
  // count
  void load_keys(int64_t k0, int64_t count, int64_t h, float* keys_t, float* values) const {
    for (int64_t j = 0; j < KEY_TILE; ++j) {
      if (j >= count) {
        for (int64_t d = 0; d < D; ++d) keys_t[d * KEY_TILE + j] = 0.0f, values[j * D + d] = 0.0f;
        continue;
      }
      const int64_t pos = k0 + j;
      const int64_t at = table[pos / block_size] * block_stride + h * head_stride + (pos % block_size) * D;
      if constexpr (PAIRED) {
        const float* pairs = reinterpret_cast<const float*>(kc + at);  // D / 2 pairs of bfloat16, as 32-bit words
        for (int64_t d = 0; d < D / 2; ++d) keys_t[d * KEY_TILE + j] = pairs[d];
      } else {
        alignas(64) float key[D];
        k_load.rows(key, kc + at, D);
        for (int64_t d = 0; d < D; ++d) keys_t[d * KEY_TILE + j] = key[d];
      }
      v_load.rows(values + j * D, vc + at, D);
    }
  }

  // One key tile of a row's online softmax: its scores s become probabilities (0 past visible), the row's running
  // maximum and sum move on; returns the factor the row's accumulated values are rescaled by.
  static float softmax_step(float* s, int64_t visible, float& maximum, float* sum) {
    float tile_max = MASKED;
    for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, s[j]);
    const float new_max = std::max(maximum, tile_max), rescale = std::exp(maximum - new_max);
    const IVec iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    Vec total = load(sum) * rescale;
    for (int64_t j = 0; j < KEY_TILE; j += LANES) {
      const Vec e = exp_nonpositive(load(s + j) - new_max);
      const Vec p = iota + static_cast<int>(j) < static_cast<int>(visible) ? e : Vec{0};
      store(s + j, p);
      total += p;
    }
    store(sum, total);
    maximum = new_max;
    return rescale;
  }
};

template <typename scalar_t, int64_t D, typename cache_t>
static void prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                    const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& query_start_loc, const torch::Tensor& context_lens, double scale,
                    const float* k_lut, const float* v_lut) {
  const int64_t num_seqs = context_lens.size(0), q_heads = query.size(1), kv_heads = key_cache.size(1);
  const int64_t block_size = key_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t *starts = query_start_loc.data_ptr<int64_t>(), *cached = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  struct Work { int64_t cost, seq, t0, n, h; };
  std::vector<Work> work;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t0 = starts[s]; t0 < starts[s + 1]; t0 += TILE_TOKENS) {
      const int64_t n = std::min(TILE_TOKENS, starts[s + 1] - t0), last = cached[s] + t0 - starts[s] + n;
      TORCH_CHECK(last <= max_blocks * block_size, "paged_attention_prefill (cpu): sequence ", s,
                  " reaches past its block table");
      for (int64_t h = 0; h < kv_heads; ++h) work.push_back({n * last, s, t0, n, h});
    }
  std::sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work.size()));
  std::vector<std::vector<int64_t>> dealt(threads);
  std::vector<int64_t> load(threads, 0);
  for (int64_t w = 0; w < static_cast<int64_t>(work.size()); ++w) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    dealt[least].push_back(w);
    load[least] += work[w].cost;
  }
  PrefillTask<scalar_t, D, cache_t> task{query.data_ptr<scalar_t>(), key_cache.data_ptr<cache_t>(),
                                          value_cache.data_ptr<cache_t>(), Dequant<cache_t>::of(k_lut),
                                          Dequant<cache_t>::of(v_lut), out.data_ptr<scalar_t>(), nullptr, q_heads,
                                          q_heads / kv_heads, block_size, kv_heads * block_size * D,
                                          block_size * D, static_cast<float>(scale)};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    PrefillTask<scalar_t, D, cache_t> mine = task;
    for (int64_t thread = begin; thread < end; ++thread)
      for (int64_t w : dealt[thread]) {
        const Work& item = work[w];
        mine.table = tables + item.seq * max_blocks;
        mine.run(item.t0, item.n, cached[item.seq] + item.t0 - starts[item.seq], item.h, buffer);
      }
  });
}

bool paged_attention_prefill(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor query_start_loc,
                             torch::Tensor context_lens, double scale, torch::Tensor k_lut, torch::Tensor v_lut) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              out.is_contiguous() && block_tables.is_contiguous() && query_start_loc.is_contiguous() &&
              context_lens.is_contiguous(), "paged_attention_prefill (cpu): tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong,
              "paged_attention_prefill (cpu): block_tables, query_start_loc and context_lens must be int64");
  TORCH_CHECK((query.scalar_type() == key_cache.scalar_type() || key_cache.scalar_type() == at::kByte) &&
              out.scalar_type() == query.scalar_type(),
              "paged_attention_prefill (cpu): query, caches (unless FP8 codes, uint8) and out must share a dtype");
  check_luts("paged_attention_prefill (cpu)", key_cache, value_cache, k_lut, v_lut);
  const bool fp8 = key_cache.scalar_type() == at::kByte;
  const float* k_table = fp8 ? k_lut.data_ptr<float>() : nullptr;
  const float* v_table = fp8 ? v_lut.data_ptr<float>() : nullptr;
  TORCH_CHECK(query_start_loc.numel() == context_lens.numel() + 1 && block_tables.size(0) == context_lens.numel(),
              "paged_attention_prefill (cpu): one start per sequence and one more, one table per sequence");
  bool done = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_prefill", [&] {
    auto run = [&](auto head_size) {  // the head size a compile-time constant: row accumulators stay in registers
      constexpr int64_t D = decltype(head_size)::value;
      if (fp8)
        prefill<scalar_t, D, uint8_t>(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                      context_lens, scale, k_table, v_table);
      else
        prefill<scalar_t, D, scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                       context_lens, scale, nullptr, nullptr);
      done = true;
    };
    switch (query.size(2)) {
      case 32: run(std::integral_constant<int64_t, 32>{}); break;
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: break;
    }
  });
  return done;
}

// Qwen3's per-head q/k RMSNorm, rotary embedding and the paged cache write in one pass over the tokens: the contract
// of paged_kernels.qk_norm_rope_write. q [T, Hq, D], k and v [T, Hk, D] may be row-strided views of the merged qkv
// projection (the head dimension contiguous); q_inv [T, Hq] and k_inv [T, Hk] are each head's 1 / rms in float32,
// computed by torch (its reduction order: the result stays HF's to the last bit); cos_sin [max_position, 2 D] (cos,
// then sin, HF's layout: rotate_half pairs element i with i + D / 2); caches [num_blocks, Hk, block_size, D]; a
// negative slot is padding (not written). Each product and sum is rounded to the dtype as torch's elementwise ops
// round them, and never contracted into a fused multiply-add (the file is built with -ffast-math for the decode).
template <typename scalar_t>
__attribute__((optimize("no-fast-math", "fp-contract=off")))
static void norm_rope_head(scalar_t* dst, const scalar_t* src, float inverse, const scalar_t* weight,
                           const scalar_t* cos, const scalar_t* sin, int64_t head_dim, std::vector<scalar_t>& normed) {
  for (int64_t d = 0; d < head_dim; ++d) {
    const scalar_t scaled = static_cast<scalar_t>(static_cast<float>(src[d]) * inverse);
    normed[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) * static_cast<float>(scaled));
  }
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < head_dim; ++d) {
    const scalar_t rotated = d < half ? static_cast<scalar_t>(-static_cast<float>(normed[d + half])) : normed[d - half];
    const scalar_t a = static_cast<scalar_t>(static_cast<float>(normed[d]) * static_cast<float>(cos[d]));
    const scalar_t b = static_cast<scalar_t>(static_cast<float>(rotated) * static_cast<float>(sin[d]));
    dst[d] = static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
  }
}

// x rounded to bfloat16 and back, as c10::BFloat16's conversion rounds (to nearest even; NaN to a quiet NaN), but
// branch-free integer arithmetic, so that a loop of them vectorizes (c10's scalar conversion does not). The same
// optimize attributes as its caller's, or GCC would not inline it.
__attribute__((always_inline, optimize("no-fast-math", "fp-contract=off")))
static inline float round_bf16(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return __builtin_bit_cast(float, (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded);
}

__attribute__((always_inline, optimize("no-fast-math", "fp-contract=off")))
static inline float widen_bf16(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }

// norm_rope_head for bfloat16, the same roundings in float registers (each product and sum rounded to bfloat16,
// never fused): ``buf`` holds 2 * head_dim floats.
__attribute__((optimize("no-fast-math", "fp-contract=off")))
static void norm_rope_head_bf16(c10::BFloat16* dst, const c10::BFloat16* src, float inverse,
                                const c10::BFloat16* weight, const c10::BFloat16* cos, const c10::BFloat16* sin,
                                int64_t head_dim, float* buf) {
  const uint16_t *s = reinterpret_cast<const uint16_t*>(src), *w = reinterpret_cast<const uint16_t*>(weight);
  const uint16_t *c = reinterpret_cast<const uint16_t*>(cos), *n = reinterpret_cast<const uint16_t*>(sin);
  float *normed = buf, *out = buf + head_dim;
  for (int64_t d = 0; d < head_dim; ++d)
    normed[d] = round_bf16(widen_bf16(w[d]) * round_bf16(widen_bf16(s[d]) * inverse));
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d)
    out[d] = round_bf16(round_bf16(normed[d] * widen_bf16(c[d])) + round_bf16(-normed[d + half] * widen_bf16(n[d])));
  for (int64_t d = half; d < head_dim; ++d)
    out[d] = round_bf16(round_bf16(normed[d] * widen_bf16(c[d])) + round_bf16(normed[d - half] * widen_bf16(n[d])));
  uint16_t* o = reinterpret_cast<uint16_t*>(dst);
  for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<uint16_t>(__builtin_bit_cast(uint32_t, out[d]) >> 16);
}

// norm_rope_head_bf16 a register of 16 elements at a time, for a head whose half is a multiple of 16: rotate_half
// pairs register c of the first half with register c of the second, so each output register is two products and a
// sum of whole registers. The same operations in the same order, each rounded to bfloat16 (round_bf16's
// arithmetic), so the results are the scalar loops' bit for bit; a head of 32 is two registers.
typedef uint16_t Bf16s __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t UVec __attribute__((vector_size(LANES * sizeof(uint32_t))));
__attribute__((always_inline, optimize("no-fast-math", "fp-contract=off")))
static inline Vec round_bf16(Vec x) {
  const UVec bits = reinterpret_cast<UVec>(x);
  const UVec rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return reinterpret_cast<Vec>((bits & 0x7FFFFFFFu) > 0x7F800000u ? UVec{} + 0x7FC00000u : rounded);
}

__attribute__((always_inline, optimize("no-fast-math", "fp-contract=off")))
static inline Vec widen_bf16(const uint16_t* at) {
  Bf16s halves;
  std::memcpy(&halves, at, sizeof(halves));
  return reinterpret_cast<Vec>(__builtin_convertvector(halves, UVec) << 16);
}

__attribute__((optimize("no-fast-math", "fp-contract=off")))
static void norm_rope_head_bf16_vec(c10::BFloat16* dst, const c10::BFloat16* src, float inverse,
                                    const c10::BFloat16* weight, const c10::BFloat16* cos,
                                    const c10::BFloat16* sin, int64_t head_dim) {
  const uint16_t *s = reinterpret_cast<const uint16_t*>(src), *w = reinterpret_cast<const uint16_t*>(weight);
  const uint16_t *c = reinterpret_cast<const uint16_t*>(cos), *n = reinterpret_cast<const uint16_t*>(sin);
  uint16_t* o = reinterpret_cast<uint16_t*>(dst);
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; d += LANES) {
    const Vec lo = round_bf16(widen_bf16(w + d) * round_bf16(widen_bf16(s + d) * inverse));
    const Vec hi = round_bf16(widen_bf16(w + half + d) * round_bf16(widen_bf16(s + half + d) * inverse));
    const Vec out_lo = round_bf16(round_bf16(lo * widen_bf16(c + d)) + round_bf16(-hi * widen_bf16(n + d)));
    const Vec out_hi = round_bf16(round_bf16(hi * widen_bf16(c + half + d)) + round_bf16(lo * widen_bf16(n + half + d)));
    const Bf16s narrow_lo = __builtin_convertvector(reinterpret_cast<UVec>(out_lo) >> 16, Bf16s);
    const Bf16s narrow_hi = __builtin_convertvector(reinterpret_cast<UVec>(out_hi) >> 16, Bf16s);
    std::memcpy(o + d, &narrow_lo, sizeof(narrow_lo));
    std::memcpy(o + half + d, &narrow_hi, sizeof(narrow_hi));
  }
}

// 1 / scale in float32, what a value is multiplied by before it is rounded to FP8 (paged_kernels.fp8.inverse_scale;
// vLLM's CPU k_inv / v_inv). No fast-math here, so the division is a division.
__attribute__((optimize("no-fast-math")))
static float fp8_inverse(float scale) { return 1.0f / scale; }

// The FP8 code of x * inv (paged_kernels.fp8's contract, vLLM's CPU write): multiplied in float32, clamped to the
// format's finite range (vLLM saturates), rounded toward zero. Rounding toward zero is truncation of the float's bits:
// a normal result keeps the float's exponent (rebiased) and its top MANT mantissa bits, a subnormal one is the
// magnitude's whole number of the format's smallest steps. A zero of either sign is code 0x00, a nonzero value under
// the smallest step keeps its sign (0x80), NaN is paged_kernels.fp8's NaN code (0x7F, e5m2 0x7E). No fast-math, so the
// comparisons see NaN and the multiply stays one rounding.
template <int MANT, int BIAS>
__attribute__((optimize("no-fast-math")))
static inline uint8_t encode_fp8(float x, float inv, float limit) {
  const float product = x * inv;
  const float y = product < -limit ? -limit : (product > limit ? limit : product);  // NaN stays NaN
  const uint32_t bits = __builtin_bit_cast(uint32_t, y), magnitude = bits & 0x7FFFFFFFu;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (magnitude > 0x7F800000u) return MANT == 3 ? 0x7F : 0x7E;
  if (magnitude == 0) return 0;
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent >= 1 - BIAS)
    return sign | static_cast<uint8_t>(((exponent + BIAS) << MANT) | ((magnitude & 0x7FFFFFu) >> (23 - MANT)));
  return sign | static_cast<uint8_t>(std::fabs(y) * static_cast<float>(1 << (BIAS - 1 + MANT)));
}

// A row of K or V into its cache slot: copied (the model's dtype) or quantized (fp8_format 1: e4m3, 2: e5m2).
template <typename scalar_t, typename cache_t>
static inline void store_row(cache_t* dst, const scalar_t* src, int64_t n, int fp8_format, float scale) {
  if constexpr (std::is_same<cache_t, uint8_t>::value) {
    const float inv = fp8_inverse(scale);
    if (fp8_format == 1) {
      const float limit = static_cast<float>(std::numeric_limits<c10::Float8_e4m3fn>::max());
      for (int64_t d = 0; d < n; ++d) dst[d] = encode_fp8<3, 7>(static_cast<float>(src[d]), inv, limit);
    } else {
      const float limit = static_cast<float>(std::numeric_limits<c10::Float8_e5m2>::max());
      for (int64_t d = 0; d < n; ++d) dst[d] = encode_fp8<2, 15>(static_cast<float>(src[d]), inv, limit);
    }
  } else {
    std::copy(src, src + n, dst);
  }
}

template <typename scalar_t, typename cache_t = scalar_t>
static void qk_norm_rope_write_impl(torch::Tensor& q_out, torch::Tensor& k_out, const torch::Tensor& q,
                                    const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& q_inv,
                                    const torch::Tensor& k_inv, const torch::Tensor& q_weight,
                                    const torch::Tensor& k_weight, const torch::Tensor& cos_sin,
                                    const torch::Tensor& positions, torch::Tensor& key_cache,
                                    torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
                                    int fp8_format = 0, float k_scale = 1.0f, float v_scale = 1.0f) {
  const int64_t tokens = q.size(0), q_heads = q.size(1), head_dim = q.size(2), kv_heads = k.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t q_row = q.stride(0), q_head = q.stride(1), k_row = k.stride(0), k_head = k.stride(1);
  const int64_t v_row = v.stride(0), v_head = v.stride(1), table_row = cos_sin.stride(0);
  const int64_t block_stride = kv_heads * block_size * head_dim, cache_head = block_size * head_dim;
  const scalar_t *q_base = q.data_ptr<scalar_t>(), *k_base = k.data_ptr<scalar_t>(), *v_base = v.data_ptr<scalar_t>();
  const scalar_t *qw = q_weight.data_ptr<scalar_t>(), *kw = k_weight.data_ptr<scalar_t>();
  const scalar_t* table = cos_sin.data_ptr<scalar_t>();
  const int64_t *pos = positions.data_ptr<int64_t>(), *slots = slot_mapping.data_ptr<int64_t>();
  scalar_t *q_dst = q_out.data_ptr<scalar_t>(), *k_dst = k_out.data_ptr<scalar_t>();
  cache_t *kc = key_cache.data_ptr<cache_t>(), *vc = value_cache.data_ptr<cache_t>();
  const float *qi = q_inv.data_ptr<float>(), *ki = k_inv.data_ptr<float>();

  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> normed(head_dim);
    std::vector<float> buf(2 * head_dim);
    auto head = [&](scalar_t* dst, const scalar_t* src, float inverse, const scalar_t* weight, const scalar_t* cos,
                    const scalar_t* sin) {
      if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
        if (head_dim % (2 * LANES) == 0)
          norm_rope_head_bf16_vec(dst, src, inverse, weight, cos, sin, head_dim);
        else
          norm_rope_head_bf16(dst, src, inverse, weight, cos, sin, head_dim, buf.data());
      }
      else
        norm_rope_head(dst, src, inverse, weight, cos, sin, head_dim, normed);
    };
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* cos = table + pos[t] * table_row;
      const scalar_t* sin = cos + head_dim;
      for (int64_t h = 0; h < q_heads; ++h)
        head(q_dst + (t * q_heads + h) * head_dim, q_base + t * q_row + h * q_head, qi[t * q_heads + h], qw, cos,
             sin);
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        scalar_t* key = k_dst + (t * kv_heads + h) * head_dim;
        head(key, k_base + t * k_row + h * k_head, ki[t * kv_heads + h], kw, cos, sin);
        if (slot < 0) continue;
        const int64_t at = (slot / block_size) * block_stride + h * cache_head + (slot % block_size) * head_dim;
        store_row(kc + at, key, head_dim, fp8_format, k_scale);
        store_row(vc + at, v_base + t * v_row + h * v_head, head_dim, fp8_format, v_scale);
      }
    }
  });
}

void qk_norm_rope_write(torch::Tensor q_out, torch::Tensor k_out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                        torch::Tensor q_inv, torch::Tensor k_inv, torch::Tensor q_weight, torch::Tensor k_weight,
                        torch::Tensor cos_sin, torch::Tensor positions, torch::Tensor key_cache,
                        torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t fp8_format, double k_scale,
                        double v_scale) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "qk_norm_rope_write (cpu): the head dimension of q, k and v must be contiguous");
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && q_weight.is_contiguous() && k_weight.is_contiguous() &&
              cos_sin.is_contiguous() && positions.is_contiguous() && slot_mapping.is_contiguous(),
              "qk_norm_rope_write (cpu): outputs, caches, weights, table and indices must be contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "qk_norm_rope_write (cpu): positions and slot_mapping must be int64");
  TORCH_CHECK(q_inv.scalar_type() == at::kFloat && k_inv.scalar_type() == at::kFloat && q_inv.is_contiguous() &&
              k_inv.is_contiguous() && q_inv.numel() == q.size(0) * q.size(1) &&
              k_inv.numel() == k.size(0) * k.size(1),
              "qk_norm_rope_write (cpu): q_inv and k_inv must be contiguous float32, one per token and head");
  for (const auto* t : {&k, &v, &q_weight, &k_weight, &cos_sin, &q_out, &k_out})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "qk_norm_rope_write (cpu): every float tensor must share a dtype");
  TORCH_CHECK(fp8_format == 0 || fp8_format == 1 || fp8_format == 2, "qk_norm_rope_write (cpu): fp8_format is 0, 1 or 2");
  const bool fp8 = fp8_format != 0;
  for (const auto* t : {&key_cache, &value_cache})
    TORCH_CHECK(t->scalar_type() == (fp8 ? at::kByte : q.scalar_type()),
                "qk_norm_rope_write (cpu): caches hold q's dtype, or FP8 codes (uint8) with an fp8_format");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "qk_norm_rope_write", [&] {
    if (fp8)
      qk_norm_rope_write_impl<scalar_t, uint8_t>(q_out, k_out, q, k, v, q_inv, k_inv, q_weight, k_weight, cos_sin,
                                                 positions, key_cache, value_cache, slot_mapping,
                                                 static_cast<int>(fp8_format), static_cast<float>(k_scale),
                                                 static_cast<float>(v_scale));
    else
      qk_norm_rope_write_impl<scalar_t>(q_out, k_out, q, k, v, q_inv, k_inv, q_weight, k_weight, cos_sin, positions,
                                        key_cache, value_cache, slot_mapping);
  });
}

// Each row's argmax as torch.argmax(dim=-1) gives it: the first index of the row's largest value, or of its first
// NaN (torch ranks NaN above every number); rows of float32 or bfloat16 (widened exactly). One pass, 16 lanes: each
// lane keeps its largest value and the first index that held it; the smallest such index among the lanes holding the
// row's maximum wins. Built without fast-math, so the comparisons see NaN (torch's bfloat16 argmax widens one element
// at a time).
typedef uint16_t Halves __attribute__((vector_size(LANES * sizeof(uint16_t))));
template <typename scalar_t>
__attribute__((optimize("no-fast-math")))
static void argmax_rows_impl(const scalar_t* logits, int64_t rows, int64_t n, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = logits + r * n;
      Vec best = Vec{} - std::numeric_limits<float>::infinity();
      IVec index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, first = index, nan = {};
      int64_t i = 0;
      for (; i + LANES <= n; i += LANES, index += LANES) {
        Vec v;
        if constexpr (std::is_same<scalar_t, float>::value) {
          v = load(row + i);
        } else {
          Halves h;
          std::memcpy(&h, row + i, sizeof(h));
          v = reinterpret_cast<Vec>(__builtin_convertvector(h, IVec) << 16);
        }
        nan |= v != v;
        const IVec above = v > best;
        best = above ? v : best;
        first = above ? index : first;
      }
      float maximum = -std::numeric_limits<float>::infinity();
      int64_t at = 0;
      bool any_nan = false;
      if (i > 0)  // the lanes ran: a lane that never rose holds -inf from its first index
        for (int64_t l = 0; l < LANES; ++l) {
          any_nan = any_nan || nan[l] != 0;
          if (best[l] > maximum || (best[l] == maximum && first[l] < at)) maximum = best[l], at = first[l];
        }
      for (; i < n; ++i) {
        const float x = static_cast<float>(row[i]);
        any_nan = any_nan || x != x;
        if (x > maximum) maximum = x, at = i;
      }
      if (any_nan)
        for (int64_t j = 0; j < n; ++j)
          if (static_cast<float>(row[j]) != static_cast<float>(row[j])) {
            at = j;
            break;
          }
      out[r] = at;
    }
  });
}

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows (cpu): logits must be a contiguous [rows, n] tensor with n > 0");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax_rows (cpu): logits must be float32 or bfloat16");
  torch::Tensor out = torch::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat)
    argmax_rows_impl(logits.data_ptr<float>(), logits.size(0), logits.size(1), out.data_ptr<int64_t>());
  else
    argmax_rows_impl(logits.data_ptr<c10::BFloat16>(), logits.size(0), logits.size(1), out.data_ptr<int64_t>());
  return out;
}

bool fp8_dequantizes_by_bits(torch::Tensor lut) {
  TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.is_contiguous() && lut.numel() == 256,
              "fp8_dequantizes_by_bits (cpu): a contiguous float32 table of 256 entries");
  return Dequant<uint8_t>::of(lut.data_ptr<float>()).vector;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(dim=-1) (CPU, float32 or bfloat16)");
  m.def("fp8_dequantizes_by_bits", &fp8_dequantizes_by_bits,
        "whether the kernels dequantize this FP8 table's codes 16 at a time through float16 (else by lookups)");
  m.def("paged_attention_decode", &paged_attention_decode,
        "GQA paged decode attention reading the block pool in place (CPU)");
  m.def("paged_attention_prefill", &paged_attention_prefill,
        "causal attention of prompt chunks over the paged cache, read in place (CPU); false for an unsupported head size");
  m.def("qk_norm_rope_write", &qk_norm_rope_write,
        "Qwen3's q/k RMSNorm, rotary embedding and the paged cache write in one pass (CPU)");
}
