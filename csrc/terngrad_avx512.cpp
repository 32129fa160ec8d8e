// AVX-512 kernels for CPUs that have AVX-512 F/BW/VL/DQ and BMI2 (checked at run time; see terngrad_cpu.cpp).
//
// Philox in 64-bit lanes: vpmuludq yields the full 32x32 -> 64-bit product per lane, so a round is two
// multiplies, two shifts and two three-way XORs (vpternlogq) for eight streams, against eighteen AVX2
// operations. Only the low 32 bits of a lane are meaningful; the high halves hold garbage that vpmuludq
// ignores and vpmovqd drops. Per element the compare writes a mask register directly.
// Decode turns 16 code bytes into 64-bit "plus" and "minus" masks with pext and adds them into int8
// counters with masked adds, two operations per 64 elements and rank.
//
// Same bytes as the scalar and AVX2 paths: tests/test_codec.py compares all of them with the reference.
#include "terngrad_internal.h"

#include <cstring>

#include "philox.h"
#include "terngrad.h"

#if defined(__x86_64__)
// GCC 12 warns inside its own avx512fintrin.h (_mm512_undefined_* in inlined intrinsics): a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#define TG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,bmi2,avx2,fma,f16c")))

namespace tg {
namespace {

TG_AVX512 inline __m512 load16(int dtype, const void* x, int64_t i) {
  switch (dtype) {
    case TG_F32:
      return _mm512_loadu_ps(static_cast<const float*>(x) + i);
    case TG_F64: {
      const double* p = static_cast<const double*>(x) + i;
      const __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(p));
      const __m256 hi = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
      return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    }
    case TG_F16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i)));
    default: {  // bf16
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// Sixteen fp16 or bf16 values as fp32, and sixteen fp32 rounded to them as round8 in terngrad_cpu.cpp rounds (to
// nearest even; every NaN the one NaN of that path: fp16 keeps the sign, bf16 gives 0x7fc0).
TG_AVX512 inline __m512 widen16(int dtype, __m256i h) {
  if (dtype == TG_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TG_AVX512 inline __m256i round16(int dtype, __m512 f) {
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);  // rare: the common case skips the NaN blend
  const __m512i bits = _mm512_castps_si512(f);
  if (dtype == TG_F16) {
    const __m256i h = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (__builtin_expect(!nan, 1)) return h;
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x8000)),
                                          _mm512_set1_epi32(0x7e00));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(_mm512_cvtepu16_epi32(h), nan, quiet));
  }
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  if (__builtin_expect(nan != 0, 0)) h = _mm512_mask_mov_epi32(h, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(h);
}

// The four output words of Philox blocks j0 .. j0+7 (j0 a multiple of 8), one 32-bit lane per block.
TG_AVX512 inline void philox8(uint64_t j0, const Key& key, const __m512i* K0, const __m512i* K1, __m256i out[4]) {
  const __m512i M0 = _mm512_set1_epi64(TG_PHILOX_M0), M1 = _mm512_set1_epi64(TG_PHILOX_M1);
  __m512i c0 = _mm512_add_epi64(_mm512_set1_epi64((uint32_t)j0), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
  __m512i c1 = _mm512_set1_epi64((uint32_t)(j0 >> 32 & 0xffffu) | key.c1_hi);
  __m512i c2 = _mm512_set1_epi64(key.tensor_id), c3 = _mm512_set1_epi64(key.step);
  for (int r = 0; r < 10; ++r) {
    const __m512i p0 = _mm512_mul_epu32(M0, c0);
    const __m512i p1 = _mm512_mul_epu32(M1, c2);
    c0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p1, 32), c1, K0[r], 0x96);
    c1 = p1;
    c2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), c3, K1[r], 0x96);
    c3 = p0;
  }
  out[0] = _mm512_cvtepi64_epi32(c0);
  out[1] = _mm512_cvtepi64_epi32(c1);
  out[2] = _mm512_cvtepi64_epi32(c2);
  out[3] = _mm512_cvtepi64_epi32(c3);
}

}  // namespace

bool avx512_usable() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("avx2");
  return ok;
}

// Eight elements widened to double: one per lane, as the statistics order requires.
TG_AVX512 inline __m512d load8d(int dtype, const void* x, int64_t i) {
  switch (dtype) {
    case TG_F32:
      return _mm512_cvtps_pd(_mm256_loadu_ps(static_cast<const float*>(x) + i));
    case TG_F64:
      return _mm512_loadu_pd(static_cast<const double*>(x) + i);
    case TG_F16:
      return _mm512_cvtps_pd(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i))));
    default: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
      return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
}

TG_AVX512 inline double scalar_at(int dtype, const void* x, int64_t i) {  // reads element i only
  switch (dtype) {
    case TG_F32: return static_cast<const float*>(x)[i];
    case TG_F64: return static_cast<const double*>(x)[i];
    case TG_F16: return _cvtsh_ss(static_cast<const uint16_t*>(x)[i]);
    default: {
      const uint32_t bits = (uint32_t) static_cast<const uint16_t*>(x)[i] << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

TG_AVX512 StatPartial stats_block_avx512(int dtype, const void* x, int64_t n, double x0, const float* r) {
  const double big = dtype == TG_F64 ? 1.7976931348623157e308 : 3.4028234663852886e38;
  const __m512d vx0 = _mm512_set1_pd(x0), vbig = _mm512_set1_pd(big);
  const __m512d absmask = _mm512_castsi512_pd(_mm512_set1_epi64(0x7fffffffffffffffLL));
  __m512d s = _mm512_setzero_pd(), q = _mm512_setzero_pd(), m = _mm512_setzero_pd();
  int64_t bad = 0, k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m512d v = r ? _mm512_cvtps_pd(_mm256_add_ps(_mm256_loadu_ps(static_cast<const float*>(x) + k),
                                                       _mm256_loadu_ps(r + k)))
                        : load8d(dtype, x, k);
    const __m512d a = _mm512_and_pd(v, absmask);
    const __m512d d = _mm512_sub_pd(v, vx0);
    s = _mm512_add_pd(s, d);
    q = _mm512_add_pd(q, _mm512_mul_pd(d, d));
    m = _mm512_max_pd(a, m);  // (a > m) ? a : m, NaN never wins, like the scalar path
    bad += 8 - __builtin_popcount(_mm512_cmp_pd_mask(a, vbig, _CMP_LE_OQ));
  }
  alignas(64) double ls[8], lq[8], lm[8];
  _mm512_store_pd(ls, s);
  _mm512_store_pd(lq, q);
  _mm512_store_pd(lm, m);
  for (int l = 0; k < n; ++k, ++l) {  // the tail continues the lanes from 0, like the scalar path
    const double v = r ? (double)(static_cast<const float*>(x)[k] + r[k]) : scalar_at(dtype, x, k);
    const double a = v < 0 ? -v : v, d = v - x0;
    ls[l] += d;
    lq[l] += d * d;
    lm[l] = a > lm[l] ? a : lm[l];
    bad += !(a <= big);
  }
  StatPartial p;
  for (int l = 0; l < 8; ++l) {
    p.sum += ls[l];
    p.sumsq += lq[l];
    p.absmax = lm[l] > p.absmax ? lm[l] : p.absmax;
  }
  p.nonfinite = bad;
  return p;
}

TG_AVX512 void ternarize_avx512(int dtype, const void* x, int64_t b, int64_t e, const float* scalers, int64_t block,
                                const Key& key, uint8_t* out, const Feedback* fb) {
  __m512i K0[10], K1[10];
  for (int r = 0; r < 10; ++r) {
    K0[r] = _mm512_set1_epi64(key.k0 + (uint32_t)r * TG_PHILOX_W0);
    K1[r] = _mm512_set1_epi64(key.k1 + (uint32_t)r * TG_PHILOX_W1);
  }
  const __m512i one = _mm512_set1_epi32(1);
  const bool half = dtype == TG_F16 || dtype == TG_BF16;
  const int shift = __builtin_ctzll((uint64_t)block);  // block: a power of two (a 64-bit division is slow)
  for (int64_t i = b; i < e; i += 64) {
    const float s = scalers[i >> shift];  // 64 elements lie in one block
    const __m512 vs17 = _mm512_set1_ps(s * 0x1p-17f), vs = _mm512_set1_ps(s);
    // s in the element type, as the decoded codes times s are (rounding is symmetric, so -s rounds to its negation)
    const __m512 vs_t = fb && half ? widen16(dtype, round16(dtype, vs)) : vs;
    __m256i w[4];
    philox8((uint64_t)i / 8, key, K0, K1, w);
    // Transpose: the four words of block l (elements 8l .. 8l+7) into one 128-bit lane.
    const __m256i t0 = _mm256_unpacklo_epi32(w[0], w[1]), t1 = _mm256_unpacklo_epi32(w[2], w[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(w[0], w[1]), t3 = _mm256_unpackhi_epi32(w[2], w[3]);
    const __m256i a0 = _mm256_unpacklo_epi64(t0, t1), a1 = _mm256_unpackhi_epi64(t0, t1);
    const __m256i a2 = _mm256_unpacklo_epi64(t2, t3), a3 = _mm256_unpackhi_epi64(t2, t3);
    // blocks (0,1), (2,3), (4,5), (6,7) as 256-bit pairs
    const __m256i pair[4] = {_mm256_permute2x128_si256(a0, a1, 0x20), _mm256_permute2x128_si256(a2, a3, 0x20),
                             _mm256_permute2x128_si256(a0, a1, 0x31), _mm256_permute2x128_si256(a2, a3, 0x31)};
    uint64_t pos = 0, neg = 0;
    for (int v = 0; v < 4; ++v) {
      const __m512i h = _mm512_cvtepu16_epi32(pair[v]);  // 16 halves, element order
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_or_si512(_mm512_slli_epi32(h, 1), one)), vs17);
      const int64_t k = i - b + 16 * v;
      __m512 xv;  // what is coded, in fp32
      __m512d xd[2];  // fp64 with error feedback: x + r_in itself
      if (fb && dtype == TG_F64) {
        const double* p = static_cast<const double*>(x) + k;
        xd[0] = _mm512_loadu_pd(p);
        xd[1] = _mm512_loadu_pd(p + 8);
        if (fb->r_in) {
          const double* q = static_cast<const double*>(fb->r_in) + k;
          xd[0] = _mm512_add_pd(xd[0], _mm512_loadu_pd(q));
          xd[1] = _mm512_add_pd(xd[1], _mm512_loadu_pd(q + 8));
        }
        xv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(xd[0])), _mm512_cvtpd_ps(xd[1]), 1);
      } else {
        xv = load16(dtype, x, k);
        if (fb && fb->r_in) {
          xv = _mm512_add_ps(xv, load16(dtype, fb->r_in, k));
          if (half) xv = widen16(dtype, round16(dtype, xv));
        }
      }
      const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_abs_ps(xv), _CMP_LT_OQ);
      const __mmask16 sign = _mm512_movepi32_mask(_mm512_castps_si512(xv));
      if (fb) {  // r = x - s*b: b = 0 subtracts +0, as the decoded codes times s do
        const __m512 sent = _mm512_maskz_mov_ps(keep, _mm512_mask_sub_ps(vs_t, sign, _mm512_setzero_ps(), vs_t));
        if (dtype == TG_F32) {
          _mm512_storeu_ps(static_cast<float*>(fb->r_out) + k, _mm512_sub_ps(xv, sent));
        } else if (dtype == TG_F64) {
          double* q = static_cast<double*>(fb->r_out) + k;
          _mm512_storeu_pd(q, _mm512_sub_pd(xd[0], _mm512_cvtps_pd(_mm512_castps512_ps256(sent))));
          _mm512_storeu_pd(q + 8, _mm512_sub_pd(xd[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(sent, 1))));
        } else {  // sent is in the element type already
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(fb->r_out) + k),
                              round16(dtype, _mm512_sub_ps(xv, sent)));
        }
      }
      pos |= (uint64_t)(uint16_t)(keep & ~sign) << (16 * v);
      neg |= (uint64_t)(uint16_t)(keep & sign) << (16 * v);
    }
    const uint64_t lo = _pdep_u64(pos, 0x5555555555555555ull) | _pdep_u64(neg, 0xAAAAAAAAAAAAAAAAull);
    const uint64_t hi = _pdep_u64(pos >> 32, 0x5555555555555555ull) | _pdep_u64(neg >> 32, 0xAAAAAAAAAAAAAAAAull);
    std::memcpy(out + i / 4, &lo, 8);
    std::memcpy(out + i / 4 + 8, &hi, 8);
  }
}

TG_AVX512 void block_max_f32_avx512(const float* x, int64_t lo, int64_t hi, int64_t n, int64_t block, double* out,
                                    const float* r) {
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    const int64_t e = b0 + block < n ? b0 + block : n;
    __m512 m = _mm512_setzero_ps();
    int64_t i = b0;
    for (; i + 16 <= e; i += 16) {
      __m512 v = _mm512_loadu_ps(x + i);
      if (r) v = _mm512_add_ps(v, _mm512_loadu_ps(r + i));
      m = _mm512_max_ps(_mm512_abs_ps(v), m);  // NaN: keeps m
    }
    float mx = _mm512_reduce_max_ps(m);
    for (; i < e; ++i) {
      const float v = r ? x[i] + r[i] : x[i];
      const float a = v < 0 ? -v : v;
      mx = a > mx ? a : mx;
    }
    out[b0 / block] = mx;
  }
}

// The "plus" (code 0b01) and "minus" (0b10) bits of 64 elements: 16 code bytes through pext.
TG_AVX512 inline void code_masks(const uint8_t* bytes, uint64_t& plus, uint64_t& minus) {
  const uint64_t EVEN = 0x5555555555555555ull, ODD = 0xAAAAAAAAAAAAAAAAull;
  uint64_t w0, w1;
  std::memcpy(&w0, bytes, 8);
  std::memcpy(&w1, bytes + 8, 8);
  plus = _pext_u64(w0, EVEN) | _pext_u64(w1, EVEN) << 32;
  minus = _pext_u64(w0, ODD) | _pext_u64(w1, ODD) << 32;
}

// The code sums of 64 elements (16 code bytes at byte0 of every rank) in int8 lanes; invalid codes into badbits.
TG_AVX512 inline __m512i count_codes(int nranks, const uint8_t* const* codes, int64_t byte0, uint64_t& badbits) {
  const __m512i one = _mm512_set1_epi8(1);
  __m512i acc = _mm512_setzero_si512();
  for (int r = 0; r < nranks; ++r) {
    uint64_t p, n;
    code_masks(codes[r] + byte0, p, n);
    badbits |= p & n;
    acc = _mm512_mask_add_epi8(acc, p, acc, one);
    acc = _mm512_mask_sub_epi8(acc, n, acc, one);
  }
  return acc;
}

TG_AVX512 void sum_shards_avx512(int nranks, const uint8_t* const* shards, int64_t b0, int64_t nbytes, int bits,
                                 uint8_t* out, uint32_t& bad) {
  uint64_t badbits = 0;
  const __m512i offset = _mm512_set1_epi8((char)nranks);
  for (int64_t g = b0; g < b0 + nbytes; g += 16) {  // 16 code bytes: 64 elements, one int8 lane each
    const __m512i acc = _mm512_add_epi8(count_codes(nranks, shards, g, badbits), offset);  // sum + N, in [0, 2N]
    if (bits == 8) {
      _mm512_storeu_si512(out + 4 * g, acc);
    } else {  // two a byte, element 2k in the low nibble: a 16-bit lane holds elements 2k (low), 2k+1 (high)
      const __m512i lo = _mm512_and_si512(acc, _mm512_set1_epi16(0xff));
      const __m512i nib = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_srli_epi16(acc, 8), 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * g), _mm512_cvtepi16_epi8(nib));
    }
  }
  if (badbits) bad |= 1;
}

TG_AVX512 void decode_avx512(int nranks, const uint8_t* const* codes, const float* weights, int shared, float post,
                             int64_t start, int64_t len, float* out, uint32_t& bad) {
  uint64_t badbits = 0;
  for (int64_t g = start; g < start + len; g += 64) {
    const int64_t byte0 = g / 4;
    if (shared) {
      const __m512i acc = count_codes(nranks, codes, byte0, badbits);
      const __m512 vp = _mm512_set1_ps(post);
      alignas(64) int8_t lanes[64];
      _mm512_store_si512(reinterpret_cast<__m512i*>(lanes), acc);
      for (int q = 0; q < 4; ++q) {
        const __m128i b8 = _mm_load_si128(reinterpret_cast<const __m128i*>(lanes + 16 * q));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b8));
        _mm512_storeu_ps(out + g + 16 * q, _mm512_mul_ps(f, vp));
      }
    } else {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int r = 0; r < nranks; ++r) {
        uint64_t p, n;
        code_masks(codes[r] + byte0, p, n);
        badbits |= p & n;
        const __m512 wv = _mm512_set1_ps(weights[r]);
        for (int q = 0; q < 4; ++q) {
          acc[q] = _mm512_mask_add_ps(acc[q], (__mmask16)(p >> (16 * q)), acc[q], wv);
          acc[q] = _mm512_mask_sub_ps(acc[q], (__mmask16)(n >> (16 * q)), acc[q], wv);
        }
      }
      for (int q = 0; q < 4; ++q) _mm512_storeu_ps(out + g + 16 * q, acc[q]);
    }
  }
  if (badbits) bad |= 1;
}

}  // namespace tg

#else  // not x86-64: no AVX-512 path

namespace tg {
bool avx512_usable() { return false; }
StatPartial stats_block_avx512(int, const void*, int64_t, double, const float*) { return StatPartial(); }
void ternarize_avx512(int, const void*, int64_t, int64_t, const float*, int64_t, const Key&, uint8_t*,
                      const Feedback*) {}
void decode_avx512(int, const uint8_t* const*, const float*, int, float, int64_t, int64_t, float*, uint32_t&) {}
void block_max_f32_avx512(const float*, int64_t, int64_t, int64_t, int64_t, double*, const float*) {}
void sum_shards_avx512(int, const uint8_t* const*, int64_t, int64_t, int, uint8_t*, uint32_t&) {}
}  // namespace tg

#endif
