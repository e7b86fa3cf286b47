// Shared by every kernel source of MiniPaged Lab (prepended to each before NVRTC or nvcc compiles it): the 16-bit
// float types carried as structs and converted with PTX, so no CUDA header is needed.

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

// ---- FP8 KV-cache elements (the contract of paged_kernels/fp8.py) ------------------------------------------------
// A cache of FP8 codes stores one byte per element; the format is in the type, so one kernel template serves 16-bit,
// float and FP8 caches (a CACHE_T template parameter). The conversions are written out in integer arithmetic rather
// than taken from cuda_fp8.h: no header (NVRTC compiles these sources as they are), the same code on sm_80 (which has
// no FP8 cvt instruction) and sm_90, and __host__ __device__, so the lab compiles the encoder as host code too and
// checks it bit for bit against fp8.quantize on the CPU (tests/test_cupy_fp8.py).
struct fp8_e4m3_t { unsigned char bits; };  // e4m3fn: no infinities, 0x7F / 0xFF are NaN, max 448
struct fp8_e5m2_t { unsigned char bits; };  // IEEE-like: max 57344

template <typename C> struct fp8_format { static constexpr bool IS_FP8 = false; };
template <> struct fp8_format<fp8_e4m3_t> {
  static constexpr bool IS_FP8 = true;
  static constexpr int MAN = 3, BIAS = 7;
  static constexpr unsigned int MAX_BITS = 0x43e00000u;  // 448.0f: |x| >= this saturates
  static constexpr unsigned int MAX_CODE = 0x7eu, NAN_CODE = 0x7fu;
  static constexpr float UNIT = 256.0f;  // a code read as the f16 (sign | code << 7) is value / UNIT
};
template <> struct fp8_format<fp8_e5m2_t> {
  static constexpr bool IS_FP8 = true;
  static constexpr int MAN = 2, BIAS = 15;
  static constexpr unsigned int MAX_BITS = 0x47600000u;  // 57344.0f
  static constexpr unsigned int MAX_CODE = 0x7bu, NAN_CODE = 0x7eu;
  static constexpr float UNIT = 1.0f;  // a code is the upper byte of an f16 of the same value
};

__host__ __device__ __forceinline__ unsigned int float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  unsigned int u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// The FP8 code of x: clamped to +-max (never inf or NaN from a number), rounded to nearest, ties to the even code;
// NaN gives the format's positive NaN code (0x7F e4m3, 0x7E e5m2), as fp8.quantize does. Float subnormals are far
// below half the smallest FP8 subnormal and give (signed) zero.
template <typename C> __host__ __device__ __forceinline__ unsigned char fp8_encode(float x) {
  using F = fp8_format<C>;
  const unsigned int u = float_bits(x), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
  if (a > 0x7f800000u) return (unsigned char)F::NAN_CODE;
  if (a >= F::MAX_BITS) return (unsigned char)(sign | F::MAX_CODE);
  const int e = (int)(a >> 23) - 127;  // the unbiased exponent (-127: zero or a float subnormal)
  unsigned int code = 0u;
  if (e >= 1 - F::BIAS) {  // an FP8 normal: drop 23 - MAN mantissa bits (a carry moves into the exponent)
    constexpr int SHIFT = 23 - F::MAN;
    const unsigned int rounded = a + ((1u << (SHIFT - 1)) - 1u) + ((a >> SHIFT) & 1u);
    code = (rounded >> SHIFT) - ((unsigned int)(127 - F::BIAS) << F::MAN);
  } else if (a >= 0x00800000u) {  // an FP8 subnormal (or zero, or the smallest normal after rounding)
    const int shift = 23 + (1 - F::BIAS - F::MAN) - e;  // value / 2^(1 - BIAS - MAN) = m / 2^shift
    const unsigned int m = (a & 0x007fffffu) | 0x00800000u;
    if (shift <= 24) code = (m + (1u << (shift - 1)) - 1u + ((m >> shift) & 1u)) >> shift;
  }
  return (unsigned char)(sign | code);
}

// What a cache stores for x: x itself (CACHE_T is the model's type), or its FP8 code after dividing by the
// per-tensor scale in float32 (an IEEE division: the sources are compiled without fast math).
template <typename C, typename T> __device__ __forceinline__ C to_cache(T x, float scale) {
  if constexpr (fp8_format<C>::IS_FP8) {
    return C{fp8_encode<C>(to_float(x) / scale)};
  } else {
    return x;
  }
}
