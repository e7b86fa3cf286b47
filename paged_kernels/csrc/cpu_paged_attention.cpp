// GQA paged decode attention on the CPU, reading K and V where they lie in the block pool (no gathered copy).
// One task per (sequence, kv head): the scores of its query-head group over the sequence's tokens, block by block
// through its block table, a softmax in float32, then the weighted sum of the values. The same contract as
// paged_kernels.paged_attention_decode: query [num_seqs, num_q_heads, head_dim], caches
// [num_blocks, num_kv_heads, block_size, head_dim], block_tables [num_seqs, max_blocks] (int64), seq_lens [num_seqs]
// (int64), out like query.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t>
static void decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                   const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* q_base = query.data_ptr<scalar_t>();
  const scalar_t* k_base = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const int64_t block_stride = num_kv_heads * block_size * head_dim, head_stride = block_size * head_dim;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores, maxima(group), sums(group);
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
      auto each_token = [&](const scalar_t* cache, auto&& visit) {
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
          const scalar_t* rows = cache + table[t0 / block_size] * block_stride + kv_head * head_stride;
          const int64_t count = std::min(block_size, len - t0);
          for (int64_t j = 0; j < count; ++j) visit(t0 + j, rows + j * head_dim);
        }
      };
      each_token(k_base, [&](int64_t t, const scalar_t* key) {  // the scores
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(key[d]);
          scores[g * len + t] = dot;
          maxima[g] = std::max(maxima[g], dot);
        }
      });
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
      each_token(v_base, [&](int64_t t, const scalar_t* value) {  // the weighted values
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_base + (seq * num_q_heads + kv_head * group + g) * head_dim;
        const float inverse = 1.0f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inverse);
      }
    }
  });
}

void paged_attention_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                            double scale) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              out.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_attention_decode (cpu): tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention_decode (cpu): block_tables and seq_lens must be int64");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention_decode (cpu): query, caches and out must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_decode", [&] {
    decode<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale);
  });
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

template <typename scalar_t>
static void qk_norm_rope_write_impl(torch::Tensor& q_out, torch::Tensor& k_out, const torch::Tensor& q,
                                    const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& q_inv,
                                    const torch::Tensor& k_inv, const torch::Tensor& q_weight,
                                    const torch::Tensor& k_weight, const torch::Tensor& cos_sin,
                                    const torch::Tensor& positions, torch::Tensor& key_cache,
                                    torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
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
  scalar_t *kc = key_cache.data_ptr<scalar_t>(), *vc = value_cache.data_ptr<scalar_t>();
  const float *qi = q_inv.data_ptr<float>(), *ki = k_inv.data_ptr<float>();

  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> normed(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* cos = table + pos[t] * table_row;
      const scalar_t* sin = cos + head_dim;
      for (int64_t h = 0; h < q_heads; ++h)
        norm_rope_head(q_dst + (t * q_heads + h) * head_dim, q_base + t * q_row + h * q_head, qi[t * q_heads + h],
                       qw, cos, sin, head_dim, normed);
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        scalar_t* key = k_dst + (t * kv_heads + h) * head_dim;
        norm_rope_head(key, k_base + t * k_row + h * k_head, ki[t * kv_heads + h], kw, cos, sin, head_dim, normed);
        if (slot < 0) continue;
        const int64_t at = (slot / block_size) * block_stride + h * cache_head + (slot % block_size) * head_dim;
        std::copy(key, key + head_dim, kc + at);
        std::copy(v_base + t * v_row + h * v_head, v_base + t * v_row + h * v_head + head_dim, vc + at);
      }
    }
  });
}

void qk_norm_rope_write(torch::Tensor q_out, torch::Tensor k_out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                        torch::Tensor q_inv, torch::Tensor k_inv, torch::Tensor q_weight, torch::Tensor k_weight,
                        torch::Tensor cos_sin, torch::Tensor positions, torch::Tensor key_cache,
                        torch::Tensor value_cache, torch::Tensor slot_mapping) {
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
  for (const auto* t : {&k, &v, &q_weight, &k_weight, &cos_sin, &key_cache, &value_cache, &q_out, &k_out})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "qk_norm_rope_write (cpu): every float tensor must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "qk_norm_rope_write", [&] {
    qk_norm_rope_write_impl<scalar_t>(q_out, k_out, q, k, v, q_inv, k_inv, q_weight, k_weight, cos_sin, positions,
                                      key_cache, value_cache, slot_mapping);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "GQA paged decode attention reading the block pool in place (CPU)");
  m.def("qk_norm_rope_write", &qk_norm_rope_write,
        "Qwen3's q/k RMSNorm, rotary embedding and the paged cache write in one pass (CPU)");
}
