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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "GQA paged decode attention reading the block pool in place (CPU)");
}
