// Paged KV cache kernels for MiniPaged Lab (compiled at run time by CuPy/NVRTC, compile-checked by nvcc in CI).
//
// Layouts: caches [num_blocks, num_kv_heads, block_size, head_dim]; key/value [num_tokens, num_kv_heads, head_dim];
// query/out [num_seqs, num_q_heads, head_dim]; block_tables int32 [num_seqs, max_blocks_per_seq]; seq_lens int32.
// The 16-bit types and conversions come from common.cuh (prepended).

// One thread block per token: copy its K/V rows (all kv heads) to the slot; negative slots are padding. FP8 caches
// (CACHE_T fp8_e4m3_t / fp8_e5m2_t) store the codes of K / k_scale and V / v_scale (to_cache); other caches ignore the
// scales.
template <typename T, typename CACHE_T = T>
__global__ void write_kv_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      CACHE_T* __restrict__ key_cache, CACHE_T* __restrict__ value_cache,
                                      const long long* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                                      int block_size, float k_scale, float v_scale) {
  const int token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long block = slot / block_size;
  const int offset = (int)(slot % block_size);
  const int row = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int head = i / head_dim;
    const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_dim + (i % head_dim);
    key_cache[dst] = to_cache<CACHE_T>(key[(long long)token * row + i], k_scale);
    value_cache[dst] = to_cache<CACHE_T>(value[(long long)token * row + i], v_scale);
  }
}

// One thread block per (src, dst) pair: copy a whole block of K and of V (FP8 caches: the unsigned char instance,
// byte for byte).
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

struct u32x4 { unsigned int x, y, z, w; };
struct u32x2 { unsigned int x, y; };
struct __align__(16) float4_t { float x, y, z, w; };

// One 16-byte read-only global load (ld.global.nc.v4.u32); the address must be 16-byte aligned.
__device__ __forceinline__ u32x4 load_16b(const u32x4* p) {
  u32x4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// One 8-byte read-only global load (ld.global.nc.v2.u32); the address must be 8-byte aligned.
__device__ __forceinline__ u32x2 load_8b(const u32x2* p) {
  u32x2 r;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// How the attention kernel loads a cache of element type C: 16-byte chunks, except FP8's 8-byte chunks, so that a
// chunk is 8 elements of a 16-bit or FP8 cache alike (16 FP8 elements per lane would need twice the registers for
// the query and accumulator: GROUP 8 would spill).
template <typename C> struct cache_chunk {
  using raw_t = u32x4;
  static __device__ __forceinline__ raw_t load(const raw_t* p) { return load_16b(p); }
};
template <> struct cache_chunk<fp8_e4m3_t> {
  using raw_t = u32x2;
  static __device__ __forceinline__ raw_t load(const raw_t* p) { return load_8b(p); }
};
template <> struct cache_chunk<fp8_e5m2_t> {
  using raw_t = u32x2;
  static __device__ __forceinline__ raw_t load(const raw_t* p) { return load_8b(p); }
};

// The 16/sizeof(T) elements of a 16-byte chunk, as floats, in memory order.
template <typename T> __device__ __forceinline__ void unpack(const u32x4& raw, float* dst);
template <> __device__ __forceinline__ void unpack<float>(const u32x4& raw, float* dst) {
  dst[0] = __uint_as_float(raw.x); dst[1] = __uint_as_float(raw.y);
  dst[2] = __uint_as_float(raw.z); dst[3] = __uint_as_float(raw.w);
}
template <> __device__ __forceinline__ void unpack<half_t>(const u32x4& raw, float* dst) {
  const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[2 * i] = to_float(half_t{(unsigned short)(words[i] & 0xffffu)});
    dst[2 * i + 1] = to_float(half_t{(unsigned short)(words[i] >> 16)});
  }
}
template <> __device__ __forceinline__ void unpack<bf16_t>(const u32x4& raw, float* dst) {
  const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[2 * i] = __uint_as_float(words[i] << 16);
    dst[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// The 8 FP8 codes of an 8-byte chunk, as floats, in memory order, each value(code) / fp8_format<C>::UNIT exactly (the
// kernel folds UNIT and the scales into the query and the output): a code becomes an f16 by integer arithmetic on
// two codes at once, then cvt.f32.f16. e5m2 is the upper byte of an f16 (NaN and inf included); e4m3fn's code c is
// the f16 (c & 0x80) << 8 | (c & 0x7F) << 7 (subnormals included) except its NaN codes 0x7F / 0xFF, which would read
// as +-1.875 (480 / UNIT): those become NaN.
__host__ __device__ __forceinline__ void fp8_pairs(unsigned int word, unsigned int& even, unsigned int& odd,
                                                    bool e4m3) {
  const unsigned int lo = word & 0x00ff00ffu, hi = (word >> 8) & 0x00ff00ffu;  // codes 0 and 2, codes 1 and 3
  if (e4m3) {
    even = ((lo & 0x00800080u) << 8) | ((lo & 0x007f007fu) << 7);
    odd = ((hi & 0x00800080u) << 8) | ((hi & 0x007f007fu) << 7);
  } else {
    even = lo << 8;
    odd = hi << 8;
  }
}
template <typename C> __device__ __forceinline__ void unpack_fp8(const u32x2& raw, float* dst) {
  constexpr bool E4M3 = fp8_format<C>::UNIT != 1.0f;
  const unsigned int words[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    unsigned int even, odd;
    fp8_pairs(words[i], even, odd, E4M3);
    dst[4 * i] = to_float(half_t{(unsigned short)(even & 0xffffu)});
    dst[4 * i + 1] = to_float(half_t{(unsigned short)(odd & 0xffffu)});
    dst[4 * i + 2] = to_float(half_t{(unsigned short)(even >> 16)});
    dst[4 * i + 3] = to_float(half_t{(unsigned short)(odd >> 16)});
  }
  if constexpr (E4M3) {
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = fabsf(dst[i]) == 1.875f ? __int_as_float(0x7fffffff) : dst[i];
  }
}
// A chunk of a cache of element type C as floats (FP8: value(code) / UNIT).
template <typename C>
__device__ __forceinline__ void unpack_chunk(const typename cache_chunk<C>::raw_t& raw, float* dst) {
  if constexpr (fp8_format<C>::IS_FP8) {
    unpack_fp8<C>(raw, dst);
  } else {
    unpack<C>(raw, dst);
  }
}

// Sum over the aligned group of WIDTH lanes that holds this lane.
template <int WIDTH> __device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Decode attention. Grid (num_kv_heads, num_seqs in this launch, num_partitions); one thread block serves one
// (sequence, kv head) and all GROUP query heads that share it, so each K/V byte is read once per group.
//
// Memory access: a K/V row of HEAD_DIM elements is read as 16-byte chunks, lane j of a token's lane group taking
// chunk j (then j + TPT, ...), so a warp's load covers whole consecutive 32-byte sectors; TOKENS_PER_WARP tokens are
// read at once by the warp's lane groups, UNROLL of them in flight per lane group. Each warp walks whole cache
// blocks (the block-table lookup and the block's base address once per block, no per-token division). Lane groups
// keep their own online softmax; they are merged with shuffles, then warps through shared memory.
// partition_size == 0: one partition per sequence (v1), the normalised output goes to `out`.
// partition_size > 0 (v2, split-K): partition p covers tokens [p * partition_size, (p + 1) * partition_size) and
// writes (max_logit, exp_sum, normalised partial output) for reduce_partitions_kernel.
// seq_len == 0 gives an output row of zeros (v1), or an empty partition (v2).
// CACHE_T: the caches' element type, T's own or FP8 (fp8_e4m3_t, fp8_e5m2_t): codes dequantized on load, value(code)
// * k_scale / v_scale, with the scales folded: q . (k * k_scale) = (q * k_scale) . k, and v_scale applied to the
// normalised output (to each partition's, which the reduction only weighs). Other caches ignore the scales.
template <typename T, int HEAD_DIM, int GROUP, int NUM_WARPS, typename CACHE_T = T>
__global__ void
paged_attention_kernel(T* __restrict__ out, float* __restrict__ max_logits, float* __restrict__ exp_sums,
                       float* __restrict__ partial_out, const T* __restrict__ query,
                       const CACHE_T* __restrict__ key_cache, const CACHE_T* __restrict__ value_cache,
                       const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale,
                       int num_kv_heads, int block_size, int max_blocks_per_seq, int partition_size,
                       int max_partitions, int seq_offset, float k_scale, float v_scale) {
  using raw_t = typename cache_chunk<CACHE_T>::raw_t;
  constexpr bool FP8 = fp8_format<CACHE_T>::IS_FP8;
  constexpr int VEC = FP8 ? 8 : 16 / (int)sizeof(CACHE_T);      // elements in one chunk (16 bytes; FP8: 8 bytes)
  constexpr int ROW_CHUNKS = HEAD_DIM / VEC;                     // chunks in one K/V row
  constexpr int TPT = ROW_CHUNKS < 32 ? ROW_CHUNKS : 32;         // lanes per token
  constexpr int CHUNKS = ROW_CHUNKS / TPT;                       // chunks per lane
  constexpr int TOKENS_PER_WARP = 32 / TPT;
  constexpr int ELEMS = CHUNKS * VEC;                            // elements per lane
  constexpr int UNROLL = GROUP * ELEMS <= 16 ? 4 : (GROUP * ELEMS <= 32 ? 2 : 1);
  constexpr int STEP = TOKENS_PER_WARP * UNROLL;                 // tokens per warp iteration
  static_assert(ROW_CHUNKS * VEC == HEAD_DIM && ROW_CHUNKS % TPT == 0, "head_dim must be whole chunks");
  static_assert(sizeof(raw_t) == VEC * sizeof(CACHE_T), "a chunk is VEC cache elements");

  const int kv_head = blockIdx.x, seq = blockIdx.y + seq_offset, part = blockIdx.z;
  const int num_q_heads = num_kv_heads * GROUP;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk_lane = lane % TPT, token_lane = lane / TPT;
  const int seq_len = seq_lens[seq];
  const int start = partition_size > 0 ? part * partition_size : 0;
  const int end = partition_size > 0 ? min(seq_len, start + partition_size) : seq_len;
  const long long q_base = (long long)seq * num_q_heads + kv_head * GROUP;

  if (start >= end) {  // an empty sequence (v1: zeros) or a partition past the sequence's end (v2)
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
      const long long q_index = q_base + i / HEAD_DIM;
      if (partition_size == 0) {
        out[q_index * HEAD_DIM + i % HEAD_DIM] = from_float<T>(0.f);
        continue;
      }
      const long long idx = q_index * max_partitions + part;
      partial_out[idx * HEAD_DIM + i % HEAD_DIM] = 0.f;
      if (i % HEAD_DIM == 0) { max_logits[idx] = NEG_INF; exp_sums[idx] = 0.f; }
    }
    return;
  }

  // Lane `chunk_lane` owns elements (c * TPT + chunk_lane) * VEC + e of the head, c < CHUNKS, e < VEC.
  float q[GROUP][ELEMS], acc[GROUP][ELEMS], m[GROUP], l[GROUP];
  float q_scale = scale, out_scale = 1.f;
  if constexpr (FP8) {
    q_scale = scale * (k_scale * fp8_format<CACHE_T>::UNIT);
    out_scale = v_scale * fp8_format<CACHE_T>::UNIT;
  }
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const T* q_row = query + (q_base + g) * HEAD_DIM;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        q[g][c * VEC + e] = to_float(q_row[(c * TPT + chunk_lane) * VEC + e]) * q_scale;
        acc[g][c * VEC + e] = 0.f;
      }
    m[g] = NEG_INF;
    l[g] = 0.f;
  }

  const int* table = block_tables + (long long)seq * max_blocks_per_seq;
  const long long block_stride = (long long)num_kv_heads * block_size * HEAD_DIM;
  const int last_block = (end - 1) / block_size;
  for (int b = start / block_size + warp; b <= last_block; b += NUM_WARPS) {  // warp-uniform
    const int block_start = b * block_size;
    const int lo = max(start, block_start) - block_start, hi = min(end, block_start + block_size) - block_start;
    const long long base = (long long)table[b] * block_stride + (long long)kv_head * block_size * HEAD_DIM;
    const raw_t* k_block = reinterpret_cast<const raw_t*>(key_cache + base);
    const raw_t* v_block = reinterpret_cast<const raw_t*>(value_cache + base);
    for (int o0 = lo; o0 < hi; o0 += STEP) {  // warp-uniform, so every lane reaches the shuffles
      raw_t k_raw[UNROLL][CHUNKS], v_raw[UNROLL][CHUNKS];
      bool valid[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int o = o0 + u * TOKENS_PER_WARP + token_lane;
        valid[u] = o < hi;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          const int chunk = o * ROW_CHUNKS + c * TPT + chunk_lane;
          k_raw[u][c] = valid[u] ? cache_chunk<CACHE_T>::load(k_block + chunk) : raw_t{};
          v_raw[u][c] = valid[u] ? cache_chunk<CACHE_T>::load(v_block + chunk) : raw_t{};
        }
      }
      float s[UNROLL][GROUP];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float k[ELEMS];
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) unpack_chunk<CACHE_T>(k_raw[u][c], k + c * VEC);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          float dot = 0.f;
#pragma unroll
          for (int i = 0; i < ELEMS; ++i) dot += q[g][i] * k[i];
          dot = group_sum<TPT>(dot);
          s[u][g] = valid[u] ? dot : NEG_INF;
        }
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float m_new = m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][g]);
        if (m_new == NEG_INF) continue;  // no valid token for this lane group in this step
        const float correction = __expf(m[g] - m_new);
        l[g] *= correction;
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) acc[g][i] *= correction;
        m[g] = m_new;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (!valid[u]) continue;
        float v[ELEMS];
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) unpack_chunk<CACHE_T>(v_raw[u][c], v + c * VEC);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          const float p = __expf(s[u][g] - m[g]);
          l[g] += p;
#pragma unroll
          for (int i = 0; i < ELEMS; ++i) acc[g][i] += p * v[i];
        }
      }
    }
  }

  // Merge the warp's lane groups (lanes chunk_lane, chunk_lane + TPT, ... hold the same elements).
#pragma unroll
  for (int offset = TPT; offset < 32; offset <<= 1)
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[g], offset);
      const float m_new = fmaxf(m[g], m_other);
      const float w_self = m[g] == NEG_INF ? 0.f : __expf(m[g] - m_new);
      const float w_other = m_other == NEG_INF ? 0.f : __expf(m_other - m_new);
      l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
      for (int i = 0; i < ELEMS; ++i)
        acc[g][i] = acc[g][i] * w_self + __shfl_xor_sync(0xffffffffu, acc[g][i], offset) * w_other;
      m[g] = m_new;
    }

  // Merge warps: warps 1.. write (m, l, acc) to shared memory, warp 0 folds them in. The accumulator is stored as
  // float4 words indexed [warp][g][word][chunk_lane], so consecutive lanes write consecutive 16 bytes (no bank
  // conflict).
  constexpr int WORDS = ELEMS / 4;
  extern __shared__ float4_t shared_words[];
  float* shared_ml = reinterpret_cast<float*>(shared_words + (NUM_WARPS - 1) * GROUP * WORDS * TPT);
  if (warp > 0 && token_lane == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int w = 0; w < WORDS; ++w)
        shared_words[(((warp - 1) * GROUP + g) * WORDS + w) * TPT + chunk_lane] =
            float4_t{acc[g][4 * w], acc[g][4 * w + 1], acc[g][4 * w + 2], acc[g][4 * w + 3]};
      if (chunk_lane == 0) {
        shared_ml[2 * ((warp - 1) * GROUP + g)] = m[g];
        shared_ml[2 * ((warp - 1) * GROUP + g) + 1] = l[g];
      }
    }
  }
  __syncthreads();
  if (warp > 0 || token_lane > 0) return;

#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int other = 0; other < NUM_WARPS - 1; ++other) {
      const float m_other = shared_ml[2 * (other * GROUP + g)], l_other = shared_ml[2 * (other * GROUP + g) + 1];
      const float m_new = fmaxf(m[g], m_other);
      const float w_self = m[g] == NEG_INF ? 0.f : __expf(m[g] - m_new);
      const float w_other = m_other == NEG_INF ? 0.f : __expf(m_other - m_new);
      l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
      for (int w = 0; w < WORDS; ++w) {
        const float4_t word = shared_words[((other * GROUP + g) * WORDS + w) * TPT + chunk_lane];
        acc[g][4 * w] = acc[g][4 * w] * w_self + word.x * w_other;
        acc[g][4 * w + 1] = acc[g][4 * w + 1] * w_self + word.y * w_other;
        acc[g][4 * w + 2] = acc[g][4 * w + 2] * w_self + word.z * w_other;
        acc[g][4 * w + 3] = acc[g][4 * w + 3] * w_self + word.w * w_other;
      }
      m[g] = m_new;
    }
    const float inv = 1.f / l[g];
    const long long q_index = q_base + g;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int d = (c * TPT + chunk_lane) * VEC + e;
        float value = acc[g][c * VEC + e] * inv;
        if constexpr (FP8) value *= out_scale;
        if (partition_size == 0) {
          out[q_index * HEAD_DIM + d] = from_float<T>(value);
        } else {
          partial_out[(q_index * max_partitions + part) * HEAD_DIM + d] = value;
        }
      }
    if (partition_size > 0 && chunk_lane == 0) {
      max_logits[q_index * max_partitions + part] = m[g];
      exp_sums[q_index * max_partitions + part] = l[g];
    }
  }
}

// v2 reduction. Grid (num_q_heads, num_seqs in this launch); threads over head_dim:
// out = sum_p w_p o_p / sum_p w_p with w_p = exp_sum_p * exp(max_logit_p - max_p max_logit_p); zeros when empty.
template <typename T, int HEAD_DIM>
__global__ void reduce_partitions_kernel(T* __restrict__ out, const float* __restrict__ max_logits,
                                         const float* __restrict__ exp_sums, const float* __restrict__ partial_out,
                                         const int* __restrict__ seq_lens, int partition_size, int max_partitions,
                                         int seq_offset) {
  const int q_head = blockIdx.x, seq = blockIdx.y + seq_offset, num_q_heads = gridDim.x;
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
    out[((long long)seq * num_q_heads + q_head) * HEAD_DIM + d] = from_float<T>(total > 0.f ? weighted / total : 0.f);
  }
}
