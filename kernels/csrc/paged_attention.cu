// Paged KV cache kernels for MiniPaged Lab (compiled at run time by CuPy/NVRTC, compile-checked by nvcc in CI).
//
// Layouts: caches [num_blocks, num_kv_heads, block_size, head_dim]; key/value [num_tokens, num_kv_heads, head_dim];
// query/out [num_seqs, num_q_heads, head_dim]; block_tables int32 [num_seqs, max_blocks_per_seq]; seq_lens int32.
// Half types are carried as 16-bit structs and converted with PTX, so no CUDA header is needed.

#define NEG_INF __int_as_float(0xff800000)

struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((unsigned int)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{(unsigned short)0x7fc0};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{(unsigned short)(u >> 16)};
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// One thread block per token: copy its K/V rows (all kv heads) to the slot; negative slots are padding.
template <typename T>
__global__ void write_kv_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      T* __restrict__ key_cache, T* __restrict__ value_cache,
                                      const long long* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                                      int block_size) {
  const int token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long block = slot / block_size;
  const int offset = (int)(slot % block_size);
  const int row = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int head = i / head_dim;
    const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_dim + (i % head_dim);
    key_cache[dst] = key[(long long)token * row + i];
    value_cache[dst] = value[(long long)token * row + i];
  }
}

// One thread block per (src, dst) pair: copy a whole block of K and of V.
template <typename T>
__global__ void copy_blocks_kernel(T* __restrict__ key_cache, T* __restrict__ value_cache,
                                   const long long* __restrict__ block_mapping, long long block_numel) {
  const long long src = block_mapping[2 * blockIdx.x] * block_numel;
  const long long dst = block_mapping[2 * blockIdx.x + 1] * block_numel;
  for (long long i = threadIdx.x; i < block_numel; i += blockDim.x) {
    key_cache[dst + i] = key_cache[src + i];
    value_cache[dst + i] = value_cache[src + i];
  }
}

// Decode attention. Grid (num_kv_heads, num_seqs, num_partitions); one thread block serves one (sequence, kv head)
// and all GROUP query heads that share it, so each K/V byte is read once per group. Each warp walks tokens
// UNROLL at a time with an online softmax; warps are merged through shared memory at the end.
// partition_size == 0: one partition per sequence (v1), the normalised output goes to `out`.
// partition_size > 0 (v2, split-K): partition p covers tokens [p * partition_size, (p + 1) * partition_size) and
// writes (max_logit, exp_sum, normalised partial output) for reduce_partitions_kernel.
template <typename T, int HEAD_DIM, int GROUP, int NUM_WARPS>
__global__ void paged_attention_kernel(T* __restrict__ out, float* __restrict__ max_logits,
                                       float* __restrict__ exp_sums, float* __restrict__ partial_out,
                                       const T* __restrict__ query, const T* __restrict__ key_cache,
                                       const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                                       const int* __restrict__ seq_lens, float scale, int num_kv_heads,
                                       int block_size, int max_blocks_per_seq, int partition_size,
                                       int max_partitions) {
  constexpr int ELEMS = HEAD_DIM / 32;  // per lane, contiguous
  constexpr int UNROLL = 4;
  const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_q_heads = num_kv_heads * GROUP;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int seq_len = seq_lens[seq];
  const int start = partition_size > 0 ? part * partition_size : 0;
  const int end = partition_size > 0 ? min(seq_len, start + partition_size) : seq_len;

  if (start >= end) {  // a partition past this sequence's end (only in v2)
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
      const long long idx = ((long long)seq * num_q_heads + kv_head * GROUP + i / HEAD_DIM) * max_partitions + part;
      partial_out[idx * HEAD_DIM + i % HEAD_DIM] = 0.f;
      if (i % HEAD_DIM == 0) { max_logits[idx] = NEG_INF; exp_sums[idx] = 0.f; }
    }
    return;
  }

  float q[GROUP][ELEMS], acc[GROUP][ELEMS], m[GROUP], l[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const T* q_row = query + ((long long)seq * num_q_heads + kv_head * GROUP + g) * HEAD_DIM + lane * ELEMS;
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) { q[g][i] = to_float(q_row[i]) * scale; acc[g][i] = 0.f; }
    m[g] = NEG_INF;
    l[g] = 0.f;
  }

  const int* table = block_tables + (long long)seq * max_blocks_per_seq;
  for (int base = start + warp * UNROLL; base < end; base += NUM_WARPS * UNROLL) {
    long long row[UNROLL];
    float k[UNROLL][ELEMS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = min(base + u, end - 1);
      const long long physical = table[t / block_size];
      row[u] = ((physical * num_kv_heads + kv_head) * block_size + t % block_size) * HEAD_DIM + lane * ELEMS;
#pragma unroll
      for (int i = 0; i < ELEMS; ++i) k[u][i] = to_float(key_cache[row[u] + i]);
    }
    float s[UNROLL][GROUP];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) dot += q[g][i] * k[u][i];
        s[u][g] = warp_sum(dot);
      }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u >= end) break;
      float v[ELEMS];
#pragma unroll
      for (int i = 0; i < ELEMS; ++i) v[i] = to_float(value_cache[row[u] + i]);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float m_new = fmaxf(m[g], s[u][g]);
        const float correction = __expf(m[g] - m_new);
        const float p = __expf(s[u][g] - m_new);
        l[g] = l[g] * correction + p;
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) acc[g][i] = acc[g][i] * correction + p * v[i];
        m[g] = m_new;
      }
    }
  }

  __shared__ float warp_m[NUM_WARPS][GROUP], warp_l[NUM_WARPS][GROUP];
  __shared__ float warp_acc[NUM_WARPS][GROUP][HEAD_DIM];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) warp_acc[warp][g][lane * ELEMS + i] = acc[g][i];
    if (lane == 0) { warp_m[warp][g] = m[g]; warp_l[warp][g] = l[g]; }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float block_max = NEG_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) block_max = fmaxf(block_max, warp_m[w][g]);
    float total = 0.f, weighted = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float weight = warp_m[w][g] == NEG_INF ? 0.f : __expf(warp_m[w][g] - block_max);
      total += warp_l[w][g] * weight;
      weighted += warp_acc[w][g][d] * weight;
    }
    const long long q_index = (long long)seq * num_q_heads + kv_head * GROUP + g;
    if (partition_size == 0) {
      out[q_index * HEAD_DIM + d] = from_float<T>(weighted / total);
    } else {
      const long long idx = q_index * max_partitions + part;
      partial_out[idx * HEAD_DIM + d] = weighted / total;
      if (d == 0) { max_logits[idx] = block_max; exp_sums[idx] = total; }
    }
  }
}

// v2 reduction. Grid (num_q_heads, num_seqs); threads over head_dim: out = sum_p w_p o_p / sum_p w_p with
// w_p = exp_sum_p * exp(max_logit_p - max_p max_logit_p).
template <typename T, int HEAD_DIM>
__global__ void reduce_partitions_kernel(T* __restrict__ out, const float* __restrict__ max_logits,
                                         const float* __restrict__ exp_sums, const float* __restrict__ partial_out,
                                         const int* __restrict__ seq_lens, int partition_size, int max_partitions) {
  const int q_head = blockIdx.x, seq = blockIdx.y, num_q_heads = gridDim.x;
  const int num_parts = (seq_lens[seq] + partition_size - 1) / partition_size;
  const long long base = ((long long)seq * num_q_heads + q_head) * max_partitions;
  float global_max = NEG_INF;
  for (int p = 0; p < num_parts; ++p) global_max = fmaxf(global_max, max_logits[base + p]);
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float total = 0.f, weighted = 0.f;
    for (int p = 0; p < num_parts; ++p) {
      const float weight = exp_sums[base + p] * __expf(max_logits[base + p] - global_max);
      total += weight;
      weighted += weight * partial_out[(base + p) * HEAD_DIM + d];
    }
    out[((long long)seq * num_q_heads + q_head) * HEAD_DIM + d] = from_float<T>(weighted / total);
  }
}
