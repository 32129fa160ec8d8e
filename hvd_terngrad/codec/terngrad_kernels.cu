// hvd_terngrad GPU kernels, compiled at run time by CuPy (NVRTC) and in the tests by nvcc.
// Same contract as csrc/terngrad.h and docs/wire-format.md: for the same inputs the packed bytes equal
// the CPU kernels' and the torch reference's. No headers, so NVRTC needs no include path.
//
// Element types: f32 = float, f64 = double, f16 and bf16 = raw unsigned short widened by bit operations.

#define TG_PHILOX_M0 0xD2511F53u
#define TG_PHILOX_M1 0xCD9E8D57u
#define TG_PHILOX_W0 0x9E3779B9u
#define TG_PHILOX_W1 0xBB67AE85u

__device__ __forceinline__ void tg_philox(unsigned int c[4], unsigned int k0, unsigned int k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const unsigned int hi0 = __umulhi(TG_PHILOX_M0, c[0]), lo0 = TG_PHILOX_M0 * c[0];
    const unsigned int hi1 = __umulhi(TG_PHILOX_M1, c[2]), lo1 = TG_PHILOX_M1 * c[2];
    const unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    k0 += TG_PHILOX_W0;
    k1 += TG_PHILOX_W1;
  }
}

// A copy of csrc/terngrad_internal.h's half_to_float, on purpose: NVRTC compiles this file alone, without
// host headers, so the two cannot share a header; the golden vectors hold both to the same bits.
__device__ __forceinline__ float tg_half_to_float(unsigned short h) {
  const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  unsigned int exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    int e = -1;
    do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
    bits = sign | ((unsigned int)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  return __uint_as_float(bits);
}

__device__ __forceinline__ float tg_load_f(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float tg_load_f(const double* p, long long i) { return __double2float_rn(p[i]); }
__device__ __forceinline__ double tg_load_d(const float* p, long long i) { return (double)p[i]; }
__device__ __forceinline__ double tg_load_d(const double* p, long long i) { return p[i]; }

struct tg_f16 { unsigned short v; };
struct tg_bf16 { unsigned short v; };
__device__ __forceinline__ float tg_load_f(const tg_f16* p, long long i) { return tg_half_to_float(p[i].v); }
__device__ __forceinline__ float tg_load_f(const tg_bf16* p, long long i) {
  return __uint_as_float((unsigned int)p[i].v << 16);
}
__device__ __forceinline__ double tg_load_d(const tg_f16* p, long long i) { return (double)tg_load_f(p, i); }
__device__ __forceinline__ double tg_load_d(const tg_bf16* p, long long i) { return (double)tg_load_f(p, i); }

// fp32 -> fp16 and bf16, rounding to nearest even: a copy of csrc/terngrad_cpu.cpp's, as tg_half_to_float is.
__device__ __forceinline__ unsigned short tg_float_to_half(float f) {
  unsigned int x = __float_as_uint(f);
  const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (x >= 0x477ff000u) return sign | 0x7c00u;
  if (x < 0x38800000u) return sign | (unsigned short)(__float_as_uint(__fadd_rn(__uint_as_float(x), 0.5f)) - 0x3f000000u);
  const unsigned int odd = (x >> 13) & 1u;
  return sign | (unsigned short)((x + ((unsigned int)(15 - 127) << 23) + 0xfffu + odd) >> 13);
}
__device__ __forceinline__ unsigned short tg_float_to_bf16(float f) {
  const unsigned int x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Error feedback's arithmetic in the gradient's type (docs/wire-format.md, section 13): x = fl_T(g + r) and
// r' = fl_T(x - fl_T(sent)), sent = s * b in fp32 (+0, s or -s).
__device__ __forceinline__ float tg_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double tg_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ tg_f16 tg_add(tg_f16 a, tg_f16 b) {
  return {tg_float_to_half(__fadd_rn(tg_half_to_float(a.v), tg_half_to_float(b.v)))};
}
__device__ __forceinline__ tg_bf16 tg_add(tg_bf16 a, tg_bf16 b) {
  return {tg_float_to_bf16(__fadd_rn(__uint_as_float((unsigned int)a.v << 16), __uint_as_float((unsigned int)b.v << 16)))};
}
__device__ __forceinline__ float tg_sub_sent(float x, float sent) { return __fsub_rn(x, sent); }
__device__ __forceinline__ double tg_sub_sent(double x, float sent) { return __dsub_rn(x, (double)sent); }
__device__ __forceinline__ tg_f16 tg_sub_sent(tg_f16 x, float sent) {
  return {tg_float_to_half(__fsub_rn(tg_half_to_float(x.v), tg_half_to_float(tg_float_to_half(sent))))};
}
__device__ __forceinline__ tg_bf16 tg_sub_sent(tg_bf16 x, float sent) {
  const float s = __uint_as_float((unsigned int)tg_float_to_bf16(sent) << 16);
  return {tg_float_to_bf16(__fsub_rn(__uint_as_float((unsigned int)x.v << 16), s))};
}

// Element i of the coded tensor: x[i], or fl_T(x[i] + r[i]) with a residual (r may be null).
template <typename T>
__device__ __forceinline__ T tg_elem(const T* x, const T* r, long long i) { return r ? tg_add(x[i], r[i]) : x[i]; }

// ---------------------------------------------------------------------------------------------------
// Statistics: each block reduces a contiguous chunk to (sum(x - x0), sum((x - x0)^2), max|x|, #non-finite)
// in double; the host adds the per-block partials in block order.
// With r: of x + r (error feedback).
template <typename T>
__device__ void tg_stats_partial_impl(const T* x, const T* r, long long n, long long chunk, double big, double* psum,
                                      double* psq, double* pmax, unsigned long long* pbad) {
  __shared__ double s_sum[256], s_sq[256], s_max[256];
  __shared__ unsigned long long s_bad[256];
  const T first = tg_elem(x, r, 0);
  const double x0 = tg_load_d(&first, 0);
  const long long begin = (long long)blockIdx.x * chunk;
  const long long end = min(n, begin + chunk);
  double sum = 0, sq = 0, mx = 0;
  unsigned long long bad = 0;
  for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const T e = tg_elem(x, r, i);
    const double v = tg_load_d(&e, 0), a = fabs(v), d = v - x0;
    sum = __dadd_rn(sum, d);
    sq = __dadd_rn(sq, __dmul_rn(d, d));
    mx = a > mx ? a : mx;
    bad += !(a <= big);
  }
  s_sum[threadIdx.x] = sum; s_sq[threadIdx.x] = sq; s_max[threadIdx.x] = mx; s_bad[threadIdx.x] = bad;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      s_sum[threadIdx.x] += s_sum[threadIdx.x + w];
      s_sq[threadIdx.x] += s_sq[threadIdx.x + w];
      s_max[threadIdx.x] = s_max[threadIdx.x + w] > s_max[threadIdx.x] ? s_max[threadIdx.x + w] : s_max[threadIdx.x];
      s_bad[threadIdx.x] += s_bad[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    psum[blockIdx.x] = s_sum[0]; psq[blockIdx.x] = s_sq[0]; pmax[blockIdx.x] = s_max[0]; pbad[blockIdx.x] = s_bad[0];
  }
}

// ---------------------------------------------------------------------------------------------------
// Ternarize + pack: one thread per Philox block j, i.e. elements 8j .. 8j+7 and output bytes 2j, 2j+1.
// Error feedback: r (may be null) is added to x, and with r_out the residual x - scaler * b is written there.
template <typename T>
__device__ __forceinline__ void tg_ternarize_block8(const T* x, const T* r, T* r_out, float scaler, long long n,
                                                    long long j, float scaler_2m17,
                                                    unsigned int k0, unsigned int k1, unsigned int c1_hi,
                                                    unsigned int tensor_id, unsigned int step, unsigned char* out) {
  unsigned int c[4] = {(unsigned int)j, (unsigned int)(((unsigned long long)j >> 32) & 0xffffu) | c1_hi, tensor_id,
                       step};
  tg_philox(c, k0, k1);
  unsigned int bits = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const long long i = 8 * j + k;
    if (i < n) {
      const unsigned int h = (c[k / 2] >> (16 * (k % 2))) & 0xffffu;
      const float t = __fmul_rn((float)(2 * h + 1), scaler_2m17);
      const T e = tg_elem(x, r, i);
      const float xf = tg_load_f(&e, 0);
      const unsigned int code = t < fabsf(xf) ? ((__float_as_uint(xf) >> 31) ? 2u : 1u) : 0u;
      bits |= code << (2 * k);
      if (r_out) r_out[i] = tg_sub_sent(e, code == 1u ? scaler : (code == 2u ? -scaler : 0.0f));
    }
  }
  out[2 * j] = (unsigned char)(bits & 0xffu);
  if (8 * j + 4 < n) out[2 * j + 1] = (unsigned char)(bits >> 8);
}

template <typename T>
__device__ void tg_ternarize_pack_impl(const T* x, long long n, float scaler_2m17, unsigned int k0, unsigned int k1,
                                       unsigned int c1_hi, unsigned int tensor_id, unsigned int step,
                                       unsigned char* out) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (8 * j < n) tg_ternarize_block8<T>(x, nullptr, nullptr, 0.0f, n, j, scaler_2m17, k0, k1, c1_hi, tensor_id, step,
                                        out);
}

// Block scalers (wire format version 2): the 8 elements of a thread lie in one block (block: a multiple of 64),
// coded with scalers_2m17[block of 8j] = fl32(s_b * 2^-17), formed by the caller as for one scaler (here
// CuPy's -ftz=true would flush a subnormal product to zero).
template <typename T>
__device__ void tg_ternarize_pack_blocks_impl(const T* x, long long n, const float* scalers_2m17, long long block,
                                              unsigned int k0, unsigned int k1, unsigned int c1_hi,
                                              unsigned int tensor_id, unsigned int step, unsigned char* out) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (8 * j < n)
    tg_ternarize_block8<T>(x, nullptr, nullptr, 0.0f, n, j, scalers_2m17[8 * j / block], k0, k1, c1_hi, tensor_id,
                           step, out);
}

// Error feedback fused in (section 13): codes of x + r (r may be null) with scalers[8j / block] (block >= n: one
// scaler), and the residual written to r_out (may be r). s2m17: fl32(s * 2^-17) of each scaler, as above.
template <typename T>
__device__ void tg_ternarize_pack_feedback_impl(const T* x, const T* r, long long n, const float* s2m17,
                                                const float* scalers, long long block, unsigned int k0,
                                                unsigned int k1, unsigned int c1_hi, unsigned int tensor_id,
                                                unsigned int step, unsigned char* out, T* r_out) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (8 * j < n) {
    const long long b = 8 * j / block;
    tg_ternarize_block8<T>(x, r, r_out, scalers[b], n, j, s2m17[b], k0, k1, c1_hi, tensor_id, step, out);
  }
}

// Per block of `block` elements, max|x| with NaN ignored, into out (zeroed by the caller) as the bits of a
// double: one thread per 8 elements, combined by an atomic max on the bit patterns, which order as the
// values do for non-negative doubles. Exact for every input type.
template <typename T>
__device__ void tg_block_absmax_impl(const T* x, const T* r, long long n, long long block, unsigned long long* out) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (8 * j >= n) return;
  double m = 0.0;
  for (long long i = 8 * j; i < 8 * j + 8 && i < n; ++i) {
    const T e = tg_elem(x, r, i);
    const double a = fabs(tg_load_d(&e, 0));
    m = a > m ? a : m;
  }
  if (m > 0.0) atomicMax(out + 8 * j / block, (unsigned long long)__double_as_longlong(m));
}

// ---------------------------------------------------------------------------------------------------
// The value of code q (0..3) of a byte: 0b01 -> +1, 0b10 -> -1, 0b00 and the invalid 0b11 -> 0.
__device__ __forceinline__ int tg_code_value(unsigned char byte, int q) {
  const unsigned int c = (byte >> (2 * q)) & 3u;
  return c == 1u ? 1 : (c == 2u ? -1 : 0);
}

// Byte k of rank r's codes, its invalid codes (0b11) or'ed into bad.
__device__ __forceinline__ unsigned char tg_code_byte(const unsigned long long* codes, int r, long long k,
                                                      unsigned int& bad) {
  const unsigned char byte = ((const unsigned char*)codes[r])[k];
  bad |= byte & (byte >> 1) & 0x55u;
  return byte;
}

// Decode: one thread per code byte (4 elements); codes[r] points at rank r's codes. weights[r * nblocks + b]
// is fl32(s / nranks) for rank r's block b (one block: nblocks = 1, block >= n). Shared: row 0 only, applied
// once to the code sum.
extern "C" __global__ void tg_decode_sum(const unsigned long long* codes, int nranks, const float* weights,
                                         long long nblocks, long long block, int shared, long long n, float* out,
                                         int* bad) {
  const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long nbytes = (n + 3) / 4;
  if (k >= nbytes) return;
  const long long b = 4 * k / block;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  unsigned int badbits = 0;
  for (int r = 0; r < nranks; ++r) {
    const unsigned char byte = tg_code_byte(codes, r, k, badbits);
    if (k == nbytes - 1 && (n % 4)) badbits |= byte >> (2 * (n % 4));
    const float w = shared ? 1.0f : weights[r * nblocks + b];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float v = (float)tg_code_value(byte, q);
      acc[q] = r == 0 ? __fmul_rn(v, w) : __fadd_rn(acc[q], __fmul_rn(v, w));
    }
  }
  if (badbits) atomicOr(bad, 1);
  const float post = weights[b];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const long long i = 4 * k + q;
    if (i < n) out[i] = shared ? __fmul_rn(acc[q], post) : acc[q];
  }
}

// ---------------------------------------------------------------------------------------------------
// Sharded transport (docs/wire-format.md, section 10). An owner's step: one thread per code byte k of its
// shard adds the nranks ranks' four codes there and writes the four sums as sum + nranks in `bits` bits.
extern "C" __global__ void tg_sum_shards(const unsigned long long* shards, int nranks, long long shard_bytes,
                                         int bits, unsigned char* out, int* bad) {
  const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= shard_bytes) return;
  int acc[4] = {0, 0, 0, 0};
  unsigned int badbits = 0;
  for (int r = 0; r < nranks; ++r) {
    const unsigned char byte = tg_code_byte(shards, r, k, badbits);
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] += tg_code_value(byte, q);
  }
  if (badbits) atomicOr(bad, 1);
  if (bits == 4) {
    out[2 * k] = (unsigned char)((acc[0] + nranks) | (acc[1] + nranks) << 4);
    out[2 * k + 1] = (unsigned char)((acc[2] + nranks) | (acc[3] + nranks) << 4);
  } else if (bits == 8) {
#pragma unroll
    for (int q = 0; q < 4; ++q) out[4 * k + q] = (unsigned char)(acc[q] + nranks);
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const unsigned int v = (unsigned int)(acc[q] + nranks);
      out[8 * k + 2 * q] = (unsigned char)(v & 0xffu);
      out[8 * k + 2 * q + 1] = (unsigned char)(v >> 8);
    }
  }
}

// Elements [start, start + n) of a stream of packed sums as fp32 means, one thread per element:
// out = fl32(float(sum) * post), post = fl32(scaler / nranks).
extern "C" __global__ void tg_decode_packed_sums(const unsigned char* packed, int nranks, int bits, long long start,
                                                 long long n, float post, float* out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long e = start + i;
  int v;
  if (bits == 4) {
    v = (packed[e / 2] >> (4 * (e & 1))) & 15;
  } else if (bits == 8) {
    v = packed[e];
  } else {
    v = packed[2 * e] | packed[2 * e + 1] << 8;
  }
  out[i] = __fmul_rn((float)(v - nranks), post);
}

// ---------------------------------------------------------------------------------------------------
// With r (stats, block_absmax): of x + r, error feedback's coded tensor; r may be null.
#define TG_INSTANTIATE(SUFFIX, T)                                                                              \
  extern "C" __global__ void tg_stats_partial_##SUFFIX(const T* x, const T* r, long long n, long long chunk,     \
                                                       double big, double* psum, double* psq, double* pmax,     \
                                                       unsigned long long* pbad) {                              \
    tg_stats_partial_impl<T>(x, r, n, chunk, big, psum, psq, pmax, pbad);                                      \
  }                                                                                                            \
  extern "C" __global__ void tg_ternarize_pack_##SUFFIX(const T* x, long long n, float scaler_2m17,             \
                                                        unsigned int k0, unsigned int k1, unsigned int c1_hi,   \
                                                        unsigned int tensor_id, unsigned int step,              \
                                                        unsigned char* out) {                                   \
    tg_ternarize_pack_impl<T>(x, n, scaler_2m17, k0, k1, c1_hi, tensor_id, step, out);                         \
  }                                                                                                            \
  extern "C" __global__ void tg_ternarize_pack_blocks_##SUFFIX(const T* x, long long n, const float* s2m17,     \
                                                               long long block, unsigned int k0, unsigned int k1, \
                                                               unsigned int c1_hi, unsigned int tensor_id,      \
                                                               unsigned int step, unsigned char* out) {         \
    tg_ternarize_pack_blocks_impl<T>(x, n, s2m17, block, k0, k1, c1_hi, tensor_id, step, out);                  \
  }                                                                                                            \
  extern "C" __global__ void tg_ternarize_pack_feedback_##SUFFIX(                                              \
      const T* x, const T* r, long long n, const float* s2m17, const float* scalers, long long block,           \
      unsigned int k0, unsigned int k1, unsigned int c1_hi, unsigned int tensor_id, unsigned int step,          \
      unsigned char* out, T* r_out) {                                                                          \
    tg_ternarize_pack_feedback_impl<T>(x, r, n, s2m17, scalers, block, k0, k1, c1_hi, tensor_id, step, out,     \
                                       r_out);                                                                 \
  }                                                                                                            \
  extern "C" __global__ void tg_block_absmax_##SUFFIX(const T* x, const T* r, long long n, long long block,      \
                                                      unsigned long long* out) {                                \
    tg_block_absmax_impl<T>(x, r, n, block, out);                                                              \
  }

TG_INSTANTIATE(f32, float)
TG_INSTANTIATE(f64, double)
TG_INSTANTIATE(f16, tg_f16)
TG_INSTANTIATE(bf16, tg_bf16)
