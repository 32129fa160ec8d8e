// The 16-bit wire of an uncoded average (docs/wire-format.md, section 9; hvd_terngrad/transports/uncoded.py):
// a gradient times a power of two, rounded to fp16, and the average back in fp32 with its largest |value|.
//
// torch does the way out in one op and the way back in two (a multiply, then aminmax and two reads), but its
// multiply into another dtype costs three times a plain conversion, and each op costs microseconds of dispatch
// whatever the tensor's size. These do each way in one pass and one call: F16C's conversions (round to nearest
// even, subnormals kept) on AVX-512 and AVX2, and the scalar conversions of torch elsewhere and for tails. All
// paths give the same bits, a NaN's payload aside (tests/test_codec.py compares them with torch's).
//
// The fp32 wire (tg_scale: the DDP hook's own average) is scaled in place before its Sum, and its largest
// |value| read in the same pass: the hook checks it against what N sums may hold (hvd_terngrad/ddp.py).
#include "terngrad.h"
#include "terngrad_internal.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 warns inside its own avx512fintrin.h (_mm512_undefined_* in inlined intrinsics): a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#define TG_X86 1
#define TG_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
#define TG_X86 0
#endif

namespace {

// The largest |value| so far and whether a NaN was seen (max ignores NaN: it is carried apart).
struct Largest {
  float m = 0.0f;
  bool nan = false;
  void add(const Largest& o) {
    m = std::max(m, o.m);
    nan = nan || o.nan;
  }
};

void to_half_scalar(const float* x, int64_t b, int64_t e, float scale, uint16_t* out) {
  for (int64_t i = b; i < e; ++i) out[i] = tg::float_to_half(x[i] * scale);
}

void from_half_scalar(const uint16_t* h, int64_t b, int64_t e, float scale, float* out, Largest& acc) {
  for (int64_t i = b; i < e; ++i) {
    const float v = tg::half_to_float(h[i]) * scale;
    out[i] = v;
    if (std::isnan(v)) acc.nan = true;
    else acc.m = std::max(acc.m, std::fabs(v));
  }
}

// The largest |value| from the bits alone, for a read that writes nothing: fp16's magnitudes order as their
// bits do with the sign masked off (an Inf's 0x7c00 above them, a NaN's above that), and rounding is monotonic,
// so fl32(largest |h| * scale) is the largest fl32(|h| * scale): the same value, without a conversion.
constexpr uint16_t kMagnitude = 0x7fff, kInfBits = 0x7c00;

uint16_t top_bits_scalar(const uint16_t* h, int64_t b, int64_t e, uint16_t top) {
  for (int64_t i = b; i < e; ++i) top = std::max<uint16_t>(top, h[i] & kMagnitude);
  return top;
}

// fp32's magnitudes order as their bits do too, the sign masked off (Inf's 0x7f800000, a NaN's above it).
constexpr uint32_t kMagnitude32 = 0x7fffffff, kInfBits32 = 0x7f800000;

uint32_t scale_scalar(float* x, int64_t b, int64_t e, float scale, uint32_t top) {
  for (int64_t i = b; i < e; ++i) {
    const float v = x[i] * scale;
    x[i] = v;
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    top = std::max(top, u & kMagnitude32);
  }
  return top;
}

#if TG_X86
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

TG_AVX2 int64_t to_half_avx2(const float* x, int64_t b, int64_t e, float scale, uint16_t* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = b;
  for (; i + 8 <= e; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), kRound));
  return i;  // the tail is the scalar path's
}

TG_AVX2 int64_t from_half_avx2(const uint16_t* h, int64_t b, int64_t e, float scale, float* out, Largest& acc) {
  const __m256 s = _mm256_set1_ps(scale), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps();
  int nan = 0;
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))), s);
    _mm256_storeu_ps(out + i, v);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, _mm256_and_ps(v, magnitude));  // a NaN lane keeps the earlier largest
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float l : lanes) acc.m = std::max(acc.m, l);
  acc.nan = acc.nan || nan;
  return i;
}

TG_AVX2 int64_t top_bits_avx2(const uint16_t* h, int64_t b, int64_t e, uint16_t& top) {
  const __m256i mask = _mm256_set1_epi16((short)kMagnitude);
  __m256i t = _mm256_setzero_si256();
  int64_t i = b;
  for (; i + 16 <= e; i += 16)
    t = _mm256_max_epu16(t, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i)), mask));
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
  for (uint16_t l : lanes) top = std::max(top, l);
  return i;  // the tail is the scalar path's
}

TG_AVX512 uint16_t top_bits_avx512(const uint16_t* h, int64_t b, int64_t e) {
  const __m512i mask = _mm512_set1_epi16((short)kMagnitude);
  __m512i t = _mm512_setzero_si512();
  for (int64_t i = b; i < e; i += 32) {
    const __mmask32 m = e - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (e - i)) - 1);
    t = _mm512_max_epu16(t, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, h + i), mask));  // masked lanes: 0
  }
  alignas(64) uint16_t lanes[32];
  _mm512_store_si512(lanes, t);
  uint16_t top = 0;
  for (uint16_t l : lanes) top = std::max(top, l);
  return top;
}

TG_AVX512 void to_half_avx512(const float* x, int64_t b, int64_t e, float scale, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = b;
  for (; i + 16 <= e; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(x + i), s), kRound));
  if (i < e) {
    const __mmask16 m = (__mmask16)((1u << (e - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, m, _mm512_cvtps_ph(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s), kRound));
  }
}

TG_AVX512 void from_half_avx512(const uint16_t* h, int64_t b, int64_t e, float scale, float* out, Largest& acc) {
  const __m512 s = _mm512_set1_ps(scale);
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = e - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (e - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h + i)), s);  // masked lanes: 0
    _mm512_mask_storeu_ps(out + i, m, v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
  }
  acc.m = std::max(acc.m, _mm512_reduce_max_ps(top));
  acc.nan = acc.nan || nan;
}

TG_AVX2 int64_t scale_avx2(float* x, int64_t b, int64_t e, float scale, uint32_t& top) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i magnitude = _mm256_set1_epi32((int)kMagnitude32);
  __m256i t = _mm256_setzero_si256();
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
    _mm256_storeu_ps(x + i, v);
    t = _mm256_max_epu32(t, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
  for (uint32_t lane : lanes) top = std::max(top, lane);
  return i;  // the tail is the scalar path's
}

TG_AVX512 uint32_t scale_avx512(float* x, int64_t b, int64_t e, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i magnitude = _mm512_set1_epi32((int)kMagnitude32);
  __m512i t = _mm512_setzero_si512();
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = e - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (e - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
    _mm512_mask_storeu_ps(x + i, m, v);
    t = _mm512_max_epu32(t, _mm512_maskz_and_epi32(m, _mm512_castps_si512(v), magnitude));
  }
  return _mm512_reduce_max_epu32(t);
}
#endif

// Ranges of whole 64-element runs; threads only from 2^22 elements: a conversion is one light pass, and below that
// starting threads costs more than they save (measured: benchmarks/codec_bench.py, the third table).
constexpr int64_t kRun = 64;

int threads_for(int64_t n, int nthreads) { return n >= (int64_t(1) << 22) ? nthreads : 1; }

void to_half_range(const float* x, int64_t b, int64_t e, float scale, uint16_t* out) {
  const int level = tg_simd_level();
#if TG_X86
  if (level >= 3) return to_half_avx512(x, b, e, scale, out);
  if (level >= 2) b = to_half_avx2(x, b, e, scale, out);
#else
  (void)level;
#endif
  to_half_scalar(x, b, e, scale, out);
}

Largest from_half_range(const uint16_t* h, int64_t b, int64_t e, float scale, float* out) {
  Largest acc;
  const int level = tg_simd_level();
#if TG_X86
  if (level >= 3) {
    from_half_avx512(h, b, e, scale, out, acc);
    return acc;
  }
  if (level >= 2) b = from_half_avx2(h, b, e, scale, out, acc);
#else
  (void)level;
#endif
  from_half_scalar(h, b, e, scale, out, acc);
  return acc;
}

uint16_t top_bits_range(const uint16_t* h, int64_t b, int64_t e) {
  uint16_t top = 0;
  const int level = tg_simd_level();
#if TG_X86
  if (level >= 3) return top_bits_avx512(h, b, e);
  if (level >= 2) b = top_bits_avx2(h, b, e, top);
#else
  (void)level;
#endif
  return top_bits_scalar(h, b, e, top);
}

uint32_t scale_range(float* x, int64_t b, int64_t e, float scale) {
  uint32_t top = 0;
  const int level = tg_simd_level();
#if TG_X86
  if (level >= 3) return scale_avx512(x, b, e, scale);
  if (level >= 2) b = scale_avx2(x, b, e, scale, top);
#else
  (void)level;
#endif
  return scale_scalar(x, b, e, scale, top);
}

// f(b, e) of each range of whole runs of [0, n), on threads from 2^22 elements: the results in range order.
template <class T, class F>
std::vector<T> per_range(int64_t n, int nthreads, F f) {
  const int64_t runs = (n + kRun - 1) / kRun;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads_for(n, nthreads), runs));
  const int64_t per = (runs + nt - 1) / nt;  // parallel_for's ranges: range k starts at k * per
  std::vector<T> part(nt);
  tg::parallel_for(runs, (int)nt, [&](int64_t rb, int64_t re) {
    part[rb / per] = f(rb * kRun, std::min(n, re * kRun));
  });
  return part;
}

// The largest |h * scale| of a read that writes nothing (top_bits_scalar), NaN where h holds one.
double largest(const uint16_t* h, int64_t n, float scale, int nthreads) {
  const std::vector<uint16_t> part =
      per_range<uint16_t>(n, nthreads, [&](int64_t b, int64_t e) { return top_bits_range(h, b, e); });
  const uint16_t top = *std::max_element(part.begin(), part.end());
  return top > kInfBits ? std::nan("") : (double)(tg::half_to_float(top) * scale);
}

Largest from_half_all(const uint16_t* h, int64_t n, float scale, float* out, int nthreads) {
  Largest all;
  for (const Largest& p : per_range<Largest>(n, nthreads, [&](int64_t b, int64_t e) {
         return from_half_range(h, b, e, scale, out);
       }))
    all.add(p);
  return all;
}

}  // namespace

extern "C" {

int tg_to_half(const float* x, int64_t n, float scale, uint16_t* out, int nthreads) {
  if (n < 0 || (n > 0 && (!x || !out))) return TG_EINVAL;
  const int64_t runs = (n + kRun - 1) / kRun;
  tg::parallel_for(runs, threads_for(n, nthreads), [&](int64_t rb, int64_t re) {
    to_half_range(x, rb * kRun, std::min(n, re * kRun), scale, out);
  });
  return TG_OK;
}

int tg_from_half(const uint16_t* h, int64_t n, float scale, float* out, int only_finite, double* absmax, int nthreads) {
  if (n < 0 || !absmax || (n > 0 && !h)) return TG_EINVAL;
  // only_finite: the largest first, then (finite) the values; the second read of h is in cache for the
  // tensors of a step, and a non-finite average leaves `out` as it was, for the caller to look at again
  if (out && !only_finite) {
    const Largest all = from_half_all(h, n, scale, out, nthreads);
    *absmax = all.nan ? std::nan("") : (double)all.m;
    return TG_OK;
  }
  *absmax = largest(h, n, scale, nthreads);
  if (out && std::isfinite(*absmax)) from_half_all(h, n, scale, out, nthreads);
  return TG_OK;
}

int tg_scale(float* x, int64_t n, float scale, double* absmax, int nthreads) {
  if (n < 0 || !absmax || (n > 0 && !x)) return TG_EINVAL;
  const std::vector<uint32_t> part =
      per_range<uint32_t>(n, nthreads, [&](int64_t b, int64_t e) { return scale_range(x, b, e, scale); });
  const uint32_t top = n ? *std::max_element(part.begin(), part.end()) : 0;
  float m;
  std::memcpy(&m, &top, sizeof m);
  *absmax = top > kInfBits32 ? std::nan("") : (double)m;
  return TG_OK;
}

// A group's tensors back to back in one buffer, in one call: a call from Python costs microseconds, more than
// the pass over a small tensor, and a step's groups are mostly small tensors.
int tg_to_half_group(int k, const float* const* xs, const int64_t* ns, const float* scales, uint16_t* out,
                     int nthreads) {
  if (k < 0 || (k > 0 && (!xs || !ns || !scales))) return TG_EINVAL;
  for (int j = 0; j < k; out += ns[j], ++j) {
    const int rc = tg_to_half(xs[j], ns[j], scales[j], out, nthreads);
    if (rc != TG_OK) return rc;
  }
  return TG_OK;
}

int tg_from_half_group(int k, const uint16_t* h, const int64_t* ns, const float* scales, float* const* outs,
                       int only_finite, double* absmax, int nthreads) {
  if (k < 0 || (k > 0 && (!ns || !scales || !absmax))) return TG_EINVAL;
  for (int j = 0; j < k; h += ns[j], ++j) {
    const int rc = tg_from_half(h, ns[j], scales[j], outs ? outs[j] : nullptr, only_finite, absmax + j, nthreads);
    if (rc != TG_OK) return rc;
  }
  return TG_OK;
}

}  // extern "C"
