// Fused transformer-layer ops for MiniPaged Lab: one launch each where eager torch takes several. Rounding follows
// HF's eager arithmetic in 16-bit types (each torch op rounds its result), so a bf16 model keeps HF's numbers
// closely; float32 accumulates. The 16-bit types and conversions come from common.cuh (prepended).

// Sum of ``value`` over the thread block (every thread gets it). ``scratch``: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// One thread block per row: residual_out = x (+ residual), out = residual_out * rsqrt(mean(residual_out^2) + eps)
// * weight. out and residual_out may not alias x or residual.
template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, T* __restrict__ residual_out, const T* __restrict__ x,
                                const T* __restrict__ residual, const T* __restrict__ weight, float eps, int hidden,
                                int has_residual) {
  __shared__ float scratch[32];
  const long long row = (long long)blockIdx.x * hidden;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float total = to_float(x[row + i]);
    if (has_residual) total = round_to<T>(total + to_float(residual[row + i]));
    residual_out[row + i] = from_float<T>(total);
    squares += total * total;
  }
  const float inverse = rsqrtf(block_sum(squares, scratch) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float normed = round_to<T>(to_float(residual_out[row + i]) * inverse);
    out[row + i] = from_float<T>(to_float(weight[i]) * normed);
  }
}

// One thread block per row of x = [gate, up] (2 * d wide): out = silu(gate) * up.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int d) {
  const long long in_row = (long long)blockIdx.x * 2 * d, out_row = (long long)blockIdx.x * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float gate = to_float(x[in_row + i]);
    const float silu = round_to<T>(gate / (1.0f + __expf(-gate)));
    out[out_row + i] = from_float<T>(silu * to_float(x[in_row + d + i]));
  }
}

// Grid (tokens, q heads + kv heads), head_dim / 2 threads, thread i owning elements i and i + head_dim / 2 (the
// rotate_half pair): RMSNorm of the head, rotary at the token's position from cos_sin [max_position, 2 * head_dim]
// (cos, then sin), written to q_out / k_out; a kv head also writes its rotated key and its value row to the paged
// caches at the token's slot (negative: padding). q, k, v rows are token_stride apart (views of a merged qkv).
// FP8 caches (CACHE_T fp8_e4m3_t / fp8_e5m2_t) store the codes of the rotated key (rounded to T first, as the torch
// op's write sees it) / k_scale and of v / v_scale; other caches ignore the scales.
template <typename T, typename CACHE_T = T>
__global__ void qk_norm_rope_write_kernel(T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ q,
                                          const T* __restrict__ k, const T* __restrict__ v,
                                          const T* __restrict__ q_weight, const T* __restrict__ k_weight,
                                          const T* __restrict__ cos_sin, const long long* __restrict__ positions,
                                          CACHE_T* __restrict__ key_cache, CACHE_T* __restrict__ value_cache,
                                          const long long* __restrict__ slot_mapping, float eps, int num_q_heads,
                                          int num_kv_heads, int head_dim, int block_size, long long q_stride,
                                          long long k_stride, long long v_stride, float k_scale, float v_scale) {
  __shared__ float scratch[32];
  const int token = blockIdx.x, head = blockIdx.y, half = head_dim / 2, i = threadIdx.x;
  const bool is_query = head < num_q_heads;
  const int kv_head = head - num_q_heads;
  const T* src = is_query ? q + token * q_stride + (long long)head * head_dim
                          : k + token * k_stride + (long long)kv_head * head_dim;
  const T* weight = is_query ? q_weight : k_weight;
  const float a = i < half ? to_float(src[i]) : 0.0f, b = i < half ? to_float(src[i + half]) : 0.0f;
  const float inverse = rsqrtf(block_sum(a * a + b * b, scratch) / head_dim + eps);
  if (i >= half) return;
  const float x1 = round_to<T>(to_float(weight[i]) * round_to<T>(a * inverse));
  const float x2 = round_to<T>(to_float(weight[i + half]) * round_to<T>(b * inverse));
  const T* row = cos_sin + positions[token] * 2 * head_dim;
  const float out1 = round_to<T>(x1 * to_float(row[i])) + round_to<T>(-x2 * to_float(row[head_dim + i]));
  const float out2 = round_to<T>(x2 * to_float(row[i + half])) + round_to<T>(x1 * to_float(row[head_dim + i + half]));
  T* dst = is_query ? q_out + ((long long)token * num_q_heads + head) * head_dim
                    : k_out + ((long long)token * num_kv_heads + kv_head) * head_dim;
  dst[i] = from_float<T>(out1);
  dst[i + half] = from_float<T>(out2);
  if (is_query) return;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long base = ((slot / block_size * num_kv_heads + kv_head) * block_size + slot % block_size) * head_dim;
  key_cache[base + i] = to_cache<CACHE_T>(from_float<T>(out1), k_scale);
  key_cache[base + i + half] = to_cache<CACHE_T>(from_float<T>(out2), k_scale);
  const T* value = v + token * v_stride + (long long)kv_head * head_dim;
  value_cache[base + i] = to_cache<CACHE_T>(value[i], v_scale);
  value_cache[base + i + half] = to_cache<CACHE_T>(value[i + half], v_scale);
}
