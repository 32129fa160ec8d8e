// hvd_terngrad CPU kernels. See terngrad.h for the contract and docs/wire-format.md for the format.
//
// Layout of the work: every kernel walks the input in fixed-size chunks that threads take in contiguous
// ranges, so results never depend on the thread count. The fp32 ternarizer has an AVX2 path (8 Philox
// streams per vector, 32 elements per iteration) picked at run time, and a scalar path that defines the
// same bits and handles tails.
#include "terngrad.h"
#include "philox.h"
#include "terngrad_internal.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TG_X86 1
#else
#define TG_X86 0
#endif

namespace {

using tg::float_to_half;
using tg::half_to_float;
using tg::parallel_for;

// ------------------------------------------------------------------------------------------------
// Element loads. fp16 and bf16 widen exactly; fp64 rounds to nearest fp32 for the ternarizer.
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <int DT> struct Elem;
template <> struct Elem<TG_F32> { using T = float; static float f(const T* p, int64_t i) { return p[i]; } static double d(const T* p, int64_t i) { return p[i]; } };
template <> struct Elem<TG_F64> { using T = double; static float f(const T* p, int64_t i) { return (float)p[i]; } static double d(const T* p, int64_t i) { return p[i]; } };
template <> struct Elem<TG_F16> { using T = uint16_t; static float f(const T* p, int64_t i) { return half_to_float(p[i]); } static double d(const T* p, int64_t i) { return half_to_float(p[i]); } };
template <> struct Elem<TG_BF16> { using T = uint16_t; static float f(const T* p, int64_t i) { return bf16_to_float(p[i]); } static double d(const T* p, int64_t i) { return bf16_to_float(p[i]); } };

// fp32 -> bf16, rounding to nearest even as torch does (c10's round_to_nearest_even), so that sums and
// differences in that type round as the torch reference's do (fp16: tg::float_to_half).
inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (std::isnan(f)) return 0x7fc0u;
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Error feedback's element arithmetic in the gradient's type, rounded once as a torch op on tensors of that
// type rounds: x = g + r, and r' = x - fl_T(sent) with sent = s * b in fp32 (0, s or -s).
template <int DT> struct Arith;
template <> struct Arith<TG_F32> {
  static float add(float a, float b) { return a + b; }
  static float sub(float x, float sent) { return x - sent; }
};
template <> struct Arith<TG_F64> {
  static double add(double a, double b) { return a + b; }
  static double sub(double x, float sent) { return x - (double)sent; }
};
template <> struct Arith<TG_F16> {
  static uint16_t add(uint16_t a, uint16_t b) { return float_to_half(half_to_float(a) + half_to_float(b)); }
  static uint16_t sub(uint16_t x, float sent) {
    return float_to_half(half_to_float(x) - half_to_float(float_to_half(sent)));
  }
};
template <> struct Arith<TG_BF16> {
  static uint16_t add(uint16_t a, uint16_t b) { return float_to_bf16(bf16_to_float(a) + bf16_to_float(b)); }
  static uint16_t sub(uint16_t x, float sent) {
    return float_to_bf16(bf16_to_float(x) - bf16_to_float(float_to_bf16(sent)));
  }
};

// buf[k] = g[k] + r[k] for k < len, in the element type: the coded tensor of error feedback, one cache-sized
// chunk at a time, so that g + r never exists whole in memory.
template <int DT>
void add_chunk(const typename Elem<DT>::T* g, const typename Elem<DT>::T* r, int64_t len,
               typename Elem<DT>::T* buf) {
  for (int64_t k = 0; k < len; ++k) buf[k] = Arith<DT>::add(g[k], r[k]);
}

// A per-thread scratch of at least n elements of T, kept between calls.
template <class T>
T* thread_scratch(int64_t n) {
  static thread_local std::vector<T> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

// Where a pass that reads each element once (statistics, block maxima) takes threads: below this many elements
// (half as many with a residual, two reads) the split saved less than handing a range to a worker cost (measured
// on a 2-core AMD EPYC: docs/results.md, "The codec on AVX2"). The ternarizer, which computes more per element,
// splits from kThreadsCoding; the decode from 2^18.
constexpr int64_t kThreadsOneRead = int64_t(1) << 23, kThreadsCoding = int64_t(1) << 20;

// ------------------------------------------------------------------------------------------------
// Statistics. Fixed blocks of kStatBlock elements; inside a block element k goes to lane k % 8.
constexpr int64_t kStatBlock = 65536;
constexpr int kLanes = 8;

using Partial = tg::StatPartial;

template <int DT>
Partial stats_block(const typename Elem<DT>::T* x, int64_t n, double x0) {
  double s[kLanes] = {0}, q[kLanes] = {0}, m[kLanes] = {0};
  int64_t bad[kLanes] = {0};
  const double big = DT == TG_F64 ? 1.7976931348623157e308 : 3.4028234663852886e38;
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double v = Elem<DT>::d(x, k + l);
      const double a = std::fabs(v);
      const double d = v - x0;
      s[l] += d;
      q[l] += d * d;
      m[l] = a > m[l] ? a : m[l];  // NaN compares false and is counted below instead
      bad[l] += !(a <= big);
    }
  }
  for (int l = 0; k < n; ++k, ++l) {
    const double v = Elem<DT>::d(x, k);
    const double a = std::fabs(v);
    const double d = v - x0;
    s[l] += d;
    q[l] += d * d;
    m[l] = a > m[l] ? a : m[l];
    bad[l] += !(a <= big);
  }
  Partial p;
  for (int l = 0; l < kLanes; ++l) {
    p.sum += s[l];
    p.sumsq += q[l];
    p.absmax = m[l] > p.absmax ? m[l] : p.absmax;
    p.nonfinite += bad[l];
  }
  return p;
}


// Highest SIMD level the kernels may use (tests lower it to check every path): 0 scalar, 2 AVX2, 3 AVX-512.
std::atomic<int> g_max_level{3};

int detected_level() {
#if TG_X86
  static const int lvl = tg::avx512_usable() ? 3
                         : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 2
                                                                                               : 0;
  return lvl;
#else
  return 0;
#endif
}

int simd_level() { return std::min(detected_level(), g_max_level.load(std::memory_order_relaxed)); }
bool has_avx2() { return simd_level() >= 2; }
bool has_avx512() { return simd_level() >= 3; }

#if TG_X86
// Eight elements as fp32 (fp64 rounded to nearest).
template <int DT>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const typename Elem<DT>::T* p) {
  if constexpr (DT == TG_F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (DT == TG_F64) {
    const __m128 lo = _mm256_cvtpd_ps(_mm256_loadu_pd(p));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_loadu_pd(p + 4));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  } else if constexpr (DT == TG_F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

// Eight fp16 or bf16 values, and eight fp32 rounded to them as float_to_half and float_to_bf16 round (to nearest
// even; every NaN the one NaN those give: F16C keeps a NaN's payload).
template <int DT>
__attribute__((target("avx2,f16c"))) inline __m256 widen8(__m128i h) {
  if constexpr (DT == TG_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int DT>
__attribute__((target("avx2,f16c"))) inline __m128i round8(__m256 f) {
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  const bool any_nan = _mm256_movemask_ps(nan) != 0;  // rare: the common case skips the NaN blend
  const __m256i bits = _mm256_castps_si256(f);
  if constexpr (DT == TG_F16) {
    const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (__builtin_expect(!any_nan, 1)) return h;
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000)),
                                          _mm256_set1_epi32(0x7e00));
    const __m256i w = _mm256_blendv_epi8(_mm256_cvtepu16_epi32(h), quiet, _mm256_castps_si256(nan));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08));
  } else {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    if (__builtin_expect(any_nan, 0)) h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
  }
}

// add_chunk at AVX2: the same sums, rounded as Arith<DT>::add rounds them.
template <int DT>
__attribute__((target("avx2,fma,f16c"))) void add_chunk_avx2(const typename Elem<DT>::T* g,
                                                             const typename Elem<DT>::T* r, int64_t len,
                                                             typename Elem<DT>::T* buf) {
  int64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    if constexpr (DT == TG_F64) {
      _mm256_storeu_pd(buf + k, _mm256_add_pd(_mm256_loadu_pd(g + k), _mm256_loadu_pd(r + k)));
      _mm256_storeu_pd(buf + k + 4, _mm256_add_pd(_mm256_loadu_pd(g + k + 4), _mm256_loadu_pd(r + k + 4)));
    } else if constexpr (DT == TG_F32) {
      _mm256_storeu_ps(buf + k, _mm256_add_ps(_mm256_loadu_ps(g + k), _mm256_loadu_ps(r + k)));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(buf + k),
                       round8<DT>(_mm256_add_ps(load8<DT>(g + k), load8<DT>(r + k))));
    }
  }
  for (; k < len; ++k) buf[k] = Arith<DT>::add(g[k], r[k]);
}

// Statistics of one block in registers, lanes 0-3 and 4-7 in two vectors of doubles: stats_block's order, to
// the bit. With r (fp32 only): of x + r, summed in fp32 and never stored.
template <int DT>
__attribute__((target("avx2,fma,f16c"))) Partial stats_block_avx2(const typename Elem<DT>::T* x, int64_t n, double x0,
                                                                  const float* r = nullptr) {
  static_assert(DT == TG_F32 || DT == TG_F64 || DT == TG_F16 || DT == TG_BF16, "element type");
  const double big = DT == TG_F64 ? 1.7976931348623157e308 : 3.4028234663852886e38;
  const __m256d vx0 = _mm256_set1_pd(x0), vbig = _mm256_set1_pd(big);
  const __m256d absmask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
  __m256d s[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()}, q[2] = {s[0], s[0]}, m[2] = {s[0], s[0]};
  int64_t bad = 0, k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    __m256d v[2];
    if constexpr (DT == TG_F64) {
      v[0] = _mm256_loadu_pd(x + k);
      v[1] = _mm256_loadu_pd(x + k + 4);
    } else {
      __m256 f = load8<DT>(x + k);
      if constexpr (DT == TG_F32) {
        if (r) f = _mm256_add_ps(f, _mm256_loadu_ps(r + k));
      }
      v[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
      v[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256d a = _mm256_and_pd(v[h], absmask), d = _mm256_sub_pd(v[h], vx0);
      s[h] = _mm256_add_pd(s[h], d);
      q[h] = _mm256_add_pd(q[h], _mm256_mul_pd(d, d));
      m[h] = _mm256_max_pd(a, m[h]);  // (a > m) ? a : m: NaN never wins, as in stats_block
      bad += 4 - __builtin_popcount(_mm256_movemask_pd(_mm256_cmp_pd(a, vbig, _CMP_LE_OQ)));
    }
  }
  alignas(32) double ls[kLanes], lq[kLanes], lm[kLanes];
  for (int h = 0; h < 2; ++h) {
    _mm256_store_pd(ls + 4 * h, s[h]);
    _mm256_store_pd(lq + 4 * h, q[h]);
    _mm256_store_pd(lm + 4 * h, m[h]);
  }
  for (int l = 0; k < n; ++k, ++l) {  // the tail continues the lanes from 0, as in stats_block
    const double vk = r ? (double)(Elem<DT>::f(x, k) + r[k]) : Elem<DT>::d(x, k);
    const double a = std::fabs(vk), d = vk - x0;
    ls[l] += d;
    lq[l] += d * d;
    lm[l] = a > lm[l] ? a : lm[l];
    bad += !(a <= big);
  }
  Partial p;
  for (int l = 0; l < kLanes; ++l) {
    p.sum += ls[l];
    p.sumsq += lq[l];
    p.absmax = lm[l] > p.absmax ? lm[l] : p.absmax;
  }
  p.nonfinite = bad;
  return p;
}

// max|x| (with r: |x + r|, fp32) of each block as block_max_range, 8 lanes at a time: a maximum is the same in
// any order.
__attribute__((target("avx2"))) void block_max_f32_avx2(const float* x, int64_t lo, int64_t hi, int64_t n,
                                                        int64_t block, double* out, const float* r = nullptr) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    const int64_t e = std::min(n, b0 + block);
    __m256 m = _mm256_setzero_ps();
    int64_t i = b0;
    for (; i + 8 <= e; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r + i));
      m = _mm256_max_ps(_mm256_and_ps(v, absmask), m);  // NaN: keeps m
    }
    alignas(32) float lm[8];
    _mm256_store_ps(lm, m);
    float mf = 0;
    for (; i < e; ++i) {
      const float a = std::fabs(r ? x[i] + r[i] : x[i]);
      mf = a > mf ? a : mf;
    }
    for (int l = 0; l < 8; ++l) mf = lm[l] > mf ? lm[l] : mf;
    out[b0 / block] = mf;
  }
}

#endif

// max|x| (NaN ignored) of each block of `block` elements that starts in [lo, hi), lo a multiple of block, into
// out[lo / block ..]; in double, exact for every input type (all but fp64 compare in fp32, exactly).
template <int DT>
void block_max_range(const typename Elem<DT>::T* x, int64_t lo, int64_t hi, int64_t n, int64_t block, double* out) {
#if TG_X86
  if constexpr (DT == TG_F32) {
    if (has_avx512()) return tg::block_max_f32_avx512(x, lo, hi, n, block, out);
    if (has_avx2()) return block_max_f32_avx2(x, lo, hi, n, block, out);
  }
#endif
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    const int64_t e = std::min(n, b0 + block);
    double md = 0;
    if (DT == TG_F64) {
      for (int64_t i = b0; i < e; ++i) {
        const double a = std::fabs(Elem<DT>::d(x, i));
        md = a > md ? a : md;
      }
    } else {
      float m[kLanes] = {0};
      int64_t i = b0;
      for (; i + kLanes <= e; i += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const float a = std::fabs(Elem<DT>::f(x, i + l));
          m[l] = a > m[l] ? a : m[l];
        }
      for (; i < e; ++i) {
        const float a = std::fabs(Elem<DT>::f(x, i));
        m[0] = a > m[0] ? a : m[0];
      }
      for (int l = 0; l < kLanes; ++l) md = m[l] > md ? m[l] : md;
    }
    out[b0 / block] = md;
  }
}

template <int DT>
void block_absmax_impl(const void* xv, int64_t n, int64_t block, double* out, int nthreads) {
  const auto* x = static_cast<const typename Elem<DT>::T*>(xv);
  const int64_t nblocks = (n + block - 1) / block;
  parallel_for(nblocks, n >= kThreadsOneRead ? nthreads : 1, [&](int64_t bb, int64_t be) {
    block_max_range<DT>(x, bb * block, std::min(n, be * block), n, block, out);
  });
}

// With block_max: also max|x| per block of `block` elements (a power of two), from the same pass: blocks up to
// kStatBlock are read again while their chunk is in cache, larger ones take their chunks' maxima.
// With r: the statistics of x + r (error feedback), each chunk summed into a per-thread scratch first.
template <int DT>
void stats_impl(const void* xv, const void* rv, int64_t n, int nthreads, double out[4], int64_t block = 0,
                double* block_max = nullptr) {
  using T = typename Elem<DT>::T;
  const auto* x = static_cast<const T*>(xv);
  const auto* r = static_cast<const T*>(rv);
  out[0] = out[1] = out[2] = out[3] = 0;
  if (n <= 0) return;
  const T first = r ? Arith<DT>::add(x[0], r[0]) : x[0];
  const double x0 = Elem<DT>::d(&first, 0);
  const int64_t nblocks = (n + kStatBlock - 1) / kStatBlock;
  std::vector<Partial> parts(nblocks);
  const bool avx2 = has_avx2(), avx512 = has_avx512();
  parallel_for(nblocks, n >= (r ? kThreadsOneRead / 2 : kThreadsOneRead) ? nthreads : 1, [&](int64_t b, int64_t e) {
    const bool fused = DT == TG_F32 && avx2;  // x + r in registers; else summed into a scratch chunk
    T* sum = r && !fused ? thread_scratch<T>(kStatBlock) : nullptr;
    for (int64_t i = b; i < e; ++i) {
      const int64_t off = i * kStatBlock, len = std::min(kStatBlock, n - off);
      const T* xs = x + off;
#if TG_X86
      if constexpr (DT == TG_F32) {
        if (r && fused) {
          const bool with_blocks = block_max && block <= kStatBlock;
          if (avx512) {
            parts[i] = tg::stats_block_avx512(DT, xs, len, x0, r + off);
            if (with_blocks) tg::block_max_f32_avx512(xs, 0, len, len, block, block_max + off / block, r + off);
          } else {
            parts[i] = stats_block_avx2<DT>(xs, len, x0, r + off);
            if (with_blocks) block_max_f32_avx2(xs, 0, len, len, block, block_max + off / block, r + off);
          }
          continue;
        }
      }
#endif
      if (r) {
#if TG_X86
        if (avx2) {
          add_chunk_avx2<DT>(x + off, r + off, len, sum);
        } else {
          add_chunk<DT>(x + off, r + off, len, sum);
        }
#else
        add_chunk<DT>(x + off, r + off, len, sum);
#endif
        xs = sum;
      }
#if TG_X86
      parts[i] = avx512 ? tg::stats_block_avx512(DT, xs, len, x0)
                 : avx2 ? stats_block_avx2<DT>(xs, len, x0)
                        : stats_block<DT>(xs, len, x0);
#else
      parts[i] = stats_block<DT>(xs, len, x0);
#endif
      // block divides kStatBlock, so the chunk's blocks are whole blocks of the tensor
      if (block_max && block <= kStatBlock) block_max_range<DT>(xs, 0, len, len, block, block_max + off / block);
    }
  });
  if (block_max && block > kStatBlock) {
    std::fill(block_max, block_max + (n + block - 1) / block, 0.0);
    for (int64_t i = 0; i < nblocks; ++i) {
      double& m = block_max[i * kStatBlock / block];
      m = parts[i].absmax > m ? parts[i].absmax : m;
    }
  }
  Partial t;
  for (const auto& p : parts) {
    t.sum += p.sum;
    t.sumsq += p.sumsq;
    t.absmax = p.absmax > t.absmax ? p.absmax : t.absmax;
    t.nonfinite += p.nonfinite;
  }
  const double md = t.sum / (double)n;  // mean of (x - x0)
  const double var = std::max(0.0, t.sumsq / (double)n - md * md);
  out[0] = x0 + md;
  out[1] = std::sqrt(var);
  out[2] = t.absmax;
  out[3] = (double)t.nonfinite;
}

// ------------------------------------------------------------------------------------------------
// Ternarize + pack.
using tg::Key;

// Keep x when t = fl((2h+1) * fl(scaler * 2^-17)) < |x|: a Bernoulli(|x| / scaler) draw whose uniform is
// the midpoint of a 16-bit cell. t < scaler always, so |x| >= scaler always keeps (clipping).
inline uint8_t code_of(float x, float scaler_2m17, uint32_t half) {
  const float t = (float)(2 * half + 1) * scaler_2m17;
  if (!(t < std::fabs(x))) return 0;
  return std::signbit(x) ? 2 : 1;
}

// Scalar path for elements [b, e), b a multiple of 8, element i read at x[i - b], with scalers[i / block] (block
// a power of two >= 8). Writes bytes b/4 .. ceil(e/4).
// Philox block j covers elements 8j .. 8j+7; element i uses 16-bit half i % 2 of word (i % 8) / 2.
// FB: error feedback in the same pass, any type: x + r_in coded (r_in may be null), r_out = that - s*b,
// read and written at [i - b] (r_out may alias r_in).
template <int DT, bool FB = false>
void ternarize_scalar(const typename Elem<DT>::T* x, int64_t b, int64_t e, const float* scalers, int64_t block,
                      const Key& key, uint8_t* out, const typename Elem<DT>::T* r_in = nullptr,
                      typename Elem<DT>::T* r_out = nullptr) {
  using T = typename Elem<DT>::T;
  const int shift = __builtin_ctzll((uint64_t)block);
  for (int64_t j = b / 8; 8 * j < e; ++j) {
    const float scaler = scalers[(8 * j) >> shift];
    const uint32_t ctr[4] = {(uint32_t)j, (uint32_t)((uint64_t)j >> 32 & 0xffffu) | key.c1_hi, key.tensor_id,
                             key.step};
    uint32_t r[4];
    tg_philox4x32_10(ctr, key.k0, key.k1, r);
    for (int half_byte = 0; half_byte < 2; ++half_byte) {
      if (8 * j + 4 * half_byte >= e) break;
      uint8_t byte = 0;
      for (int w = 0; w < 4; ++w) {
        const int k = 4 * half_byte + w;  // 0..7 inside the block
        const int64_t i = 8 * j + k;
        const uint32_t half = (r[k / 2] >> (16 * (k % 2))) & 0xffffu;
        if (i >= e) continue;
        T xi = x[i - b];
        if (FB && r_in) xi = Arith<DT>::add(xi, r_in[i - b]);
        const uint8_t code = code_of(Elem<DT>::f(&xi, 0), scaler * 0x1p-17f, half);
        if (FB) r_out[i - b] = Arith<DT>::sub(xi, code == 1 ? scaler : code == 2 ? -scaler : 0.0f);
        byte |= (uint8_t)(code << (2 * w));
      }
      out[2 * j + half_byte] = byte;
    }
  }
}

#if TG_X86
// Spread the 32 bits of v to the even bits of a 64-bit word.
inline uint64_t spread_bits(uint32_t v) {
  uint64_t x = v;
  x = (x | x << 16) & 0x0000FFFF0000FFFFull;
  x = (x | x << 8) & 0x00FF00FF00FF00FFull;
  x = (x | x << 4) & 0x0F0F0F0F0F0F0F0Full;
  x = (x | x << 2) & 0x3333333333333333ull;
  x = (x | x << 1) & 0x5555555555555555ull;
  return x;
}


// (hi, lo) halves of the eight 32x32-bit products m * c.
__attribute__((target("avx2"))) inline void mulhilo8(__m256i m, __m256i c, __m256i& hi, __m256i& lo) {
  const __m256i pe = _mm256_mul_epu32(m, c);                           // lanes 0,2,4,6
  const __m256i po = _mm256_mul_epu32(m, _mm256_srli_epi64(c, 32));    // lanes 1,3,5,7
  lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
}

// Elements [b, e) with b and e multiples of 64, element i read at x[i - b]: eight Philox blocks (one per lane) per
// iteration.
// With r_out, error feedback in the same registers, any type, as the scalar path computes it: x + r_in coded
// (r_in may be null), r_out = that - s*b, each rounded to the element type (Arith); read and written at [i - b].
template <int DT>
__attribute__((target("avx2,fma,f16c"))) void ternarize_avx2(const typename Elem<DT>::T* x, int64_t b, int64_t e,
                                                             const float* scalers, int64_t block, const Key& key,
                                                             uint8_t* out, const typename Elem<DT>::T* r_in = nullptr,
                                                             typename Elem<DT>::T* r_out = nullptr) {
  const __m256i M0 = _mm256_set1_epi32((int)TG_PHILOX_M0), M1 = _mm256_set1_epi32((int)TG_PHILOX_M1);
  __m256i K0[10], K1[10];
  for (int r = 0; r < 10; ++r) {
    K0[r] = _mm256_set1_epi32((int)(key.k0 + (uint32_t)r * TG_PHILOX_W0));
    K1[r] = _mm256_set1_epi32((int)(key.k1 + (uint32_t)r * TG_PHILOX_W1));
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i C2 = _mm256_set1_epi32((int)key.tensor_id), C3 = _mm256_set1_epi32((int)key.step);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 signmask = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  const int shift = __builtin_ctzll((uint64_t)block);  // block: a power of two (a 64-bit division is slow)
  for (int64_t i = b; i < e; i += 64) {
    const float sc = scalers[i >> shift];  // 64 elements lie in one block
    const __m256 vs17 = _mm256_set1_ps(sc * 0x1p-17f), vs = _mm256_set1_ps(sc);
    // s in the element type, as the decoded codes times s are (rounding is symmetric, so -s rounds to its negation)
    __m256 vs_t = vs;
    if constexpr (DT == TG_F16 || DT == TG_BF16) {
      if (r_out) vs_t = widen8<DT>(round8<DT>(vs));
    }
    const uint64_t j0 = (uint64_t)i / 8;  // multiple of 8: j0 lo + 7 never carries
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)j0), lane);
    __m256i c1 = _mm256_set1_epi32((int)((uint32_t)(j0 >> 32 & 0xffffu) | key.c1_hi));
    __m256i c2 = C2, c3 = C3;
    for (int r = 0; r < 10; ++r) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(M0, c0, hi0, lo0);
      mulhilo8(M1, c2, hi1, lo1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), K0[r]);
      c1 = lo1;
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), K1[r]);
      c3 = lo0;
    }
    // Transpose: the 128 bits of block l (words c0..c3 of lane l) feed elements 8l .. 8l+7.
    const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpacklo_epi32(c2, c3);
    const __m256i t2 = _mm256_unpackhi_epi32(c0, c1), t3 = _mm256_unpackhi_epi32(c2, c3);
    const __m256i a0 = _mm256_unpacklo_epi64(t0, t1), a1 = _mm256_unpackhi_epi64(t0, t1);
    const __m256i a2 = _mm256_unpacklo_epi64(t2, t3), a3 = _mm256_unpackhi_epi64(t2, t3);
    const __m128i blk[8] = {_mm256_castsi256_si128(a0), _mm256_castsi256_si128(a1),
                            _mm256_castsi256_si128(a2), _mm256_castsi256_si128(a3),
                            _mm256_extracti128_si256(a0, 1), _mm256_extracti128_si256(a1, 1),
                            _mm256_extracti128_si256(a2, 1), _mm256_extracti128_si256(a3, 1)};
    uint64_t pos = 0, neg = 0;
    for (int v = 0; v < 8; ++v) {
      const __m256i h = _mm256_cvtepu16_epi32(blk[v]);  // 16-bit halves, low half first
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(h, h), one)), vs17);
      const int64_t k = (i - b) + 8 * v;
      __m256 xv;     // what is coded, in fp32
      __m256d xd[2]; // fp64: x + r_in itself
      if constexpr (DT == TG_F64) {
        xd[0] = _mm256_loadu_pd(x + k);
        xd[1] = _mm256_loadu_pd(x + k + 4);
        if (r_in) {
          xd[0] = _mm256_add_pd(xd[0], _mm256_loadu_pd(r_in + k));
          xd[1] = _mm256_add_pd(xd[1], _mm256_loadu_pd(r_in + k + 4));
        }
        xv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(xd[0])), _mm256_cvtpd_ps(xd[1]), 1);
      } else {
        xv = load8<DT>(x + k);
        if (r_in) {
          xv = _mm256_add_ps(xv, load8<DT>(r_in + k));
          if constexpr (DT == TG_F16 || DT == TG_BF16) xv = widen8<DT>(round8<DT>(xv));
        }
      }
      const __m256 kept = _mm256_cmp_ps(t, _mm256_and_ps(xv, absmask), _CMP_LT_OQ);
      if (r_out) {  // r = x - s*b: s with x's sign where kept, else +0 (as the decoded codes times s)
        const __m256 sent = _mm256_and_ps(kept, _mm256_or_ps(vs_t, _mm256_and_ps(xv, signmask)));
        if constexpr (DT == TG_F32) {
          _mm256_storeu_ps(r_out + k, _mm256_sub_ps(xv, sent));
        } else if constexpr (DT == TG_F64) {
          _mm256_storeu_pd(r_out + k, _mm256_sub_pd(xd[0], _mm256_cvtps_pd(_mm256_castps256_ps128(sent))));
          _mm256_storeu_pd(r_out + k + 4, _mm256_sub_pd(xd[1], _mm256_cvtps_pd(_mm256_extractf128_ps(sent, 1))));
        } else {  // sent is in the element type already
          const __m256 diff = _mm256_sub_ps(xv, sent);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r_out + k), round8<DT>(diff));
        }
      }
      const uint64_t keep = (uint32_t)_mm256_movemask_ps(kept);
      const uint64_t sign = (uint32_t)_mm256_movemask_ps(xv);
      pos |= (keep & ~sign) << (8 * v);
      neg |= (keep & sign) << (8 * v);
    }
    const uint64_t lo = spread_bits((uint32_t)pos) | spread_bits((uint32_t)neg) << 1;
    const uint64_t hi = spread_bits((uint32_t)(pos >> 32)) | spread_bits((uint32_t)(neg >> 32)) << 1;
    std::memcpy(out + i / 4, &lo, 8);
    std::memcpy(out + i / 4 + 8, &hi, 8);
  }
}
#endif

// Elements [b, e) read at x[i - b]: the SIMD path in use for whole runs of 64, the scalar path for the rest.
template <int DT>
void ternarize_range(const typename Elem<DT>::T* x, int64_t b, int64_t e, const float* scalers, int64_t block,
                     const Key& key, uint8_t* out) {
  int64_t mid = b;
#if TG_X86
  if (has_avx512()) {
    mid = b + (e - b) / 64 * 64;
    tg::ternarize_avx512(DT, x, b, mid, scalers, block, key, out);
  } else if (has_avx2()) {
    mid = b + (e - b) / 64 * 64;
    ternarize_avx2<DT>(x, b, mid, scalers, block, key, out);
  }
#endif
  if (mid < e) ternarize_scalar<DT>(x + (mid - b), mid, e, scalers, block, key, out);
}

// Elements [0, n), element i with scalers[i / block] (block: a power of two >= 64; kOneBlock for one scaler), in
// work items of kChunk elements; only the tensor's last elements (past a multiple of 64) take the scalar path.
// With r_out: error feedback (x = g + r coded, r_out the new residual; r may be null, r_out may alias it).
template <int DT>
void ternarize_impl(const void* xv, const void* rv, int64_t n, const float* scalers, int64_t block, const Key& key,
                    uint8_t* out, void* rov, int nthreads) {
  using T = typename Elem<DT>::T;
  const auto* x = static_cast<const T*>(xv);
  const auto* r = static_cast<const T*>(rv);
  auto* r_out = static_cast<T*>(rov);
  constexpr int64_t kChunk = 16384;  // elements per work item, a multiple of 64
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  parallel_for(nchunks, n >= kThreadsCoding ? nthreads : 1, [&](int64_t cb, int64_t ce) {
    const int64_t b = cb * kChunk, e = std::min(n, ce * kChunk);
    if (!r_out) return ternarize_range<DT>(x + b, b, e, scalers, block, key, out);
    // fused in registers: one read of g and r, one write of r_out, the scalar path for the last elements past a
    // multiple of 64, or all of them
    int64_t mid = b;
#if TG_X86
    if (has_avx512()) {
      mid = b + (e - b) / 64 * 64;
      const tg::Feedback fb{r ? r + b : nullptr, r_out + b};
      tg::ternarize_avx512(DT, x + b, b, mid, scalers, block, key, out, &fb);
    } else if (has_avx2()) {
      mid = b + (e - b) / 64 * 64;
      ternarize_avx2<DT>(x + b, b, mid, scalers, block, key, out, r ? r + b : nullptr, r_out + b);
    }
#endif
    if (mid < e)
      ternarize_scalar<DT, true>(x + mid, mid, e, scalers, block, key, out, r ? r + mid : nullptr, r_out + mid);
  });
}

// ------------------------------------------------------------------------------------------------
// Decode: a 256-entry table turns one byte into its four values.
const tg::CodeLut<float> kLut;

constexpr int64_t kDecodeBlock = 4096;  // elements, a multiple of 4; the accumulator stays in L1

void decode_block(int nranks, const uint8_t* const* codes, const float* weights, int shared, float post,
                  int64_t start, int64_t len, float* out, uint32_t& bad) {
  alignas(64) float acc[kDecodeBlock];
  const int64_t nbytes = (len + 3) / 4, b0 = start / 4;
  for (int r = 0; r < nranks; ++r) {
    const uint8_t* c = codes[r] + b0;
    const float w = shared ? 1.0f : weights[r];
    uint32_t badr = 0;
    if (r == 0) {
      for (int64_t k = 0; k < nbytes; ++k) {
        const uint8_t byte = c[k];
        badr |= byte & (byte >> 1) & 0x55u;
        for (int q = 0; q < 4; ++q) acc[4 * k + q] = kLut.v[byte][q] * w;
      }
    } else {
      for (int64_t k = 0; k < nbytes; ++k) {
        const uint8_t byte = c[k];
        badr |= byte & (byte >> 1) & 0x55u;
        for (int q = 0; q < 4; ++q) acc[4 * k + q] += kLut.v[byte][q] * w;
      }
    }
    if (len % 4) badr |= c[nbytes - 1] >> (2 * (len % 4));  // padding codes must be 0
    bad |= badr;
  }
  if (shared) {
    for (int64_t k = 0; k < len; ++k) out[start + k] = acc[k] * post;
  } else {
    std::memcpy(out + start, acc, sizeof(float) * len);
  }
}

// The block of a tensor with one scaler: a power of two beyond any n (n < 2^50).
constexpr int64_t kOneBlock = int64_t(1) << 50;

bool block_ok(int64_t block) { return block >= 64 && block <= (int64_t(1) << 30) && (block & (block - 1)) == 0; }

int ternarize_entry(int dtype, const void* x, const void* r, int64_t n, const float* scalers, int64_t block,
                    uint64_t seed, uint32_t step, uint32_t rank, uint32_t tensor_id, uint8_t* out, void* r_out,
                    int nthreads) {
  if (n < 0 || (n > 0 && (!x || !out)) || rank > 0xffffu || (n >> 50) != 0) return TG_EINVAL;
  if (n == 0) return TG_OK;
  const Key key{(uint32_t)seed, (uint32_t)(seed >> 32), rank << 16, tensor_id, step};
  switch (dtype) {
    case TG_F32: ternarize_impl<TG_F32>(x, r, n, scalers, block, key, out, r_out, nthreads); return TG_OK;
    case TG_F64: ternarize_impl<TG_F64>(x, r, n, scalers, block, key, out, r_out, nthreads); return TG_OK;
    case TG_F16: ternarize_impl<TG_F16>(x, r, n, scalers, block, key, out, r_out, nthreads); return TG_OK;
    case TG_BF16: ternarize_impl<TG_BF16>(x, r, n, scalers, block, key, out, r_out, nthreads); return TG_OK;
    default: return TG_EDTYPE;
  }
}

// Decode with scalers[r * nblocks + k] for rank r's block k (block >= n: one scaler a rank). Work units are
// kDecodeBlock elements, or one block where blocks are smaller, so each unit has one set of weights.
int decode_impl(int nranks, const uint8_t* const* codes, const float* scalers, int shared, int64_t n, int64_t block,
                float* out, int nthreads) {
  if (nranks <= 0 || n < 0 || !codes || !scalers || (n > 0 && !out)) return TG_EINVAL;
  if (n == 0) return TG_OK;
  for (int r = 0; r < nranks; ++r)
    if (!codes[r]) return TG_EINVAL;
  const int64_t nblocks = (n + block - 1) / block, unit = std::min(kDecodeBlock, block);
  const int64_t nunits = (n + unit - 1) / unit;
  const bool simd = has_avx512() && (!shared || nranks <= 127);  // int8 counters when shared
  std::atomic<uint32_t> bad_all{0};
  parallel_for(nunits, n >= (int64_t(1) << 18) ? nthreads : 1, [&](int64_t ub, int64_t ue) {
    uint32_t bad = 0;
    std::vector<float> weights(nranks);
    int64_t have = -1;  // the block whose weights are in `weights`
    for (int64_t u = ub; u < ue; ++u) {
      int64_t start = u * unit, len = std::min(unit, n - start);
      const int64_t k = start / block;
      if (k != have) {
        for (int r = 0; r < (shared ? 1 : nranks); ++r) weights[r] = scalers[r * nblocks + k] / (float)nranks;
        have = k;
      }
      const float post = weights[0];  // shared: scalers[k] / nranks
      if (simd) {
        const int64_t full = len / 64 * 64;
        tg::decode_avx512(nranks, codes, weights.data(), shared, post, start, full, out, bad);
        start += full;
        len -= full;
      }
      if (len > 0) decode_block(nranks, codes, weights.data(), shared, post, start, len, out, bad);
    }
    bad_all |= bad;
  });
  return bad_all.load() ? 1 : TG_OK;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
extern "C" {

int tg_abi_version(void) { return TG_ABI_VERSION; }

int tg_simd_level(void) { return simd_level(); }

int tg_set_simd_level(int max_level) {
  g_max_level.store(max_level < 0 ? 0 : max_level, std::memory_order_relaxed);
  return simd_level();
}

void tg_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  tg_philox4x32_10(ctr, key[0], key[1], out);
}

int tg_stats(int dtype, const void* x, int64_t n, int nthreads, double out[4]) {
  return tg_stats_feedback(dtype, x, nullptr, n, 0, nthreads, out, nullptr);
}

int tg_stats_feedback(int dtype, const void* x, const void* r, int64_t n, int64_t block, int nthreads, double out[4],
                      double* block_max) {
  if (n < 0 || (n > 0 && !x) || !out || (block && (!block_ok(block) || (n > 0 && !block_max)))) return TG_EINVAL;
  switch (dtype) {
    case TG_F32: stats_impl<TG_F32>(x, r, n, nthreads, out, block, block_max); return TG_OK;
    case TG_F64: stats_impl<TG_F64>(x, r, n, nthreads, out, block, block_max); return TG_OK;
    case TG_F16: stats_impl<TG_F16>(x, r, n, nthreads, out, block, block_max); return TG_OK;
    case TG_BF16: stats_impl<TG_BF16>(x, r, n, nthreads, out, block, block_max); return TG_OK;
    default: return TG_EDTYPE;
  }
}

int tg_ternarize_pack(int dtype, const void* x, int64_t n, float scaler, uint64_t seed, uint32_t step,
                      uint32_t rank, uint32_t tensor_id, uint8_t* out, int nthreads) {
  return ternarize_entry(dtype, x, nullptr, n, &scaler, kOneBlock, seed, step, rank, tensor_id, out, nullptr,
                         nthreads);
}

int tg_ternarize_pack_blocks(int dtype, const void* x, int64_t n, const float* scalers, int64_t block, uint64_t seed,
                             uint32_t step, uint32_t rank, uint32_t tensor_id, uint8_t* out, int nthreads) {
  return tg_ternarize_pack_feedback(dtype, x, nullptr, n, scalers, block, seed, step, rank, tensor_id, out, nullptr,
                                    nthreads);
}

int tg_ternarize_pack_feedback(int dtype, const void* x, const void* r, int64_t n, const float* scalers, int64_t block,
                               uint64_t seed, uint32_t step, uint32_t rank, uint32_t tensor_id, uint8_t* out,
                               void* r_out, int nthreads) {
  if (block == 0) block = kOneBlock;
  else if (!block_ok(block)) return TG_EINVAL;
  if (n > 0 && (!scalers || (r && !r_out))) return TG_EINVAL;
  return ternarize_entry(dtype, x, r, n, scalers, block, seed, step, rank, tensor_id, out, r_out, nthreads);
}

int tg_decode_sum(int nranks, const uint8_t* const* codes, const float* scalers, int shared, int64_t n,
                  float* out, int nthreads) {
  return decode_impl(nranks, codes, scalers, shared, n, kOneBlock, out, nthreads);
}

int tg_decode_sum_blocks(int nranks, const uint8_t* const* codes, const float* scalers, int shared, int64_t n,
                         int64_t block, float* out, int nthreads) {
  if (!block_ok(block)) return TG_EINVAL;
  return decode_impl(nranks, codes, scalers, shared, n, block, out, nthreads);
}

int tg_stats_blocks(int dtype, const void* x, int64_t n, int64_t block, int nthreads, double out[4],
                    double* block_max) {
  if (!block) return TG_EINVAL;
  return tg_stats_feedback(dtype, x, nullptr, n, block, nthreads, out, block_max);
}

int tg_block_absmax(int dtype, const void* x, int64_t n, int64_t block, double* out, int nthreads) {
  if (n < 0 || (n > 0 && (!x || !out)) || !block_ok(block)) return TG_EINVAL;
  if (n == 0) return TG_OK;
  switch (dtype) {
    case TG_F32: block_absmax_impl<TG_F32>(x, n, block, out, nthreads); return TG_OK;
    case TG_F64: block_absmax_impl<TG_F64>(x, n, block, out, nthreads); return TG_OK;
    case TG_F16: block_absmax_impl<TG_F16>(x, n, block, out, nthreads); return TG_OK;
    case TG_BF16: block_absmax_impl<TG_BF16>(x, n, block, out, nthreads); return TG_OK;
    default: return TG_EDTYPE;
  }
}

}  // extern "C"
