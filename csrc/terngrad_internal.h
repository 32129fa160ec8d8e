// Internal declarations shared by the CPU translation units (not part of the C ABI).
#pragma once
#include <stdint.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tg {

// Worker threads kept between calls: a thread spawned per call cost 0.1-0.2 ms on a 2-core AMD EPYC, more than
// splitting a pass over 1M fp32 elements saves (docs/results.md, "The codec on AVX2"). run() hands task(t), t in
// [1, n), to the workers and runs task(0) on the caller; one caller at a time: another gets false and spawns its
// own threads. Never destroyed (workers blocked at exit must not be joined); a forked child, which has none of
// the parent's threads, starts a pool of its own.
class Pool {
 public:
  static bool run(int64_t n, const std::function<void(int64_t)>& task) {
    Pool* p = instance();
    std::unique_lock<std::mutex> caller(p->caller_, std::try_to_lock);
    if (!caller.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lk(p->m_);
      while (p->workers_ < n - 1) {  // workers 1 .. n-1; a new one waits for the generation after this
        std::thread(&Pool::work, p, ++p->workers_, p->generation_).detach();
      }
      p->task_ = &task;
      p->n_ = n;
      p->pending_ = n - 1;
      ++p->generation_;
    }
    p->wake_.notify_all();
    task(0);
    std::unique_lock<std::mutex> lk(p->m_);
    p->done_.wait(lk, [p] { return p->pending_ == 0; });
    p->task_ = nullptr;
    return true;
  }

 private:
  static std::atomic<Pool*>& slot() {
    static std::atomic<Pool*> p{nullptr};
    return p;
  }
  static Pool* instance() {
    static const int forks = pthread_atfork(nullptr, nullptr, [] { slot().store(nullptr); });
    (void)forks;
    Pool* p = slot().load();
    if (p == nullptr) {
      Pool* fresh = new Pool;
      p = slot().compare_exchange_strong(p, fresh) ? fresh : (delete fresh, p);
    }
    return p;
  }
  void work(int64_t index, uint64_t seen) {
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      wake_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= n_) continue;  // not needed this time
      const std::function<void(int64_t)>* task = task_;
      lk.unlock();
      (*task)(index);
      lk.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::mutex caller_;                            // held by the one caller of run()
  std::mutex m_;                                 // guards what follows
  std::condition_variable wake_, done_;          // a new generation; its last task done
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t n_ = 0, pending_ = 0, workers_ = 0;    // this generation's tasks, those not done, workers started
  uint64_t generation_ = 0;                      // one per run()
};

// Threads: run f(begin, end) over [0, nitems) split into at most nthreads contiguous ranges.
template <class F>
void parallel_for(int64_t nitems, int nthreads, F&& f) {
  if (nthreads <= 1 || nitems <= 1) {
    f(int64_t(0), nitems);
    return;
  }
  const int64_t nt = std::min<int64_t>(nthreads, nitems);
  const int64_t per = (nitems + nt - 1) / nt;
  const std::function<void(int64_t)> range = [&f, per, nitems](int64_t t) {
    const int64_t b = t * per, e = std::min(nitems, b + per);
    if (b < e) f(b, e);
  };
  if (Pool::run(nt, range)) return;
  std::vector<std::thread> pool;
  pool.reserve(nt - 1);
  for (int64_t t = 1; t < nt; ++t) pool.emplace_back(range, t);
  range(0);
  for (auto& th : pool) th.join();
}

// fp16 -> fp32, exactly.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: renormalize
    int e = -1;
    do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> fp16, rounding to nearest even as torch does (c10's fp16_ieee_from_fp32_value), so that sums and
// differences in that type round as the torch reference's do; F16C's conversion gives the same bits but a NaN's.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, Inf
  if (x >= 0x477ff000u) return sign | 0x7c00u;                                 // rounds past 65504: Inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half; adding 0.5 lets the fp32 adder round it
    float a;
    std::memcpy(&a, &x, 4);
    a += 0.5f;
    uint32_t ab;
    std::memcpy(&ab, &a, 4);
    return sign | (uint16_t)(ab - 0x3f000000u);
  }
  const uint32_t odd = (x >> 13) & 1u;
  return sign | (uint16_t)((x + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13);
}

// Philox key and counter words of one tensor on one rank in one step (see terngrad.h).
struct Key {
  uint32_t k0, k1, c1_hi, tensor_id, step;
};

// Statistics of one block: lane l (of 8) sums the elements k with k % 8 == l, in order; lanes are then
// added in order 0..7. Every path (scalar, AVX2, AVX-512, reference) keeps exactly this order.
struct StatPartial {
  double sum = 0, sumsq = 0, absmax = 0;
  int64_t nonfinite = 0;
};

// One code byte -> its four values in {-1, 0, +1} as T (float for the decode, int8_t for an owner's sums).
template <class T>
struct CodeLut {
  alignas(16) T v[256][4];
  CodeLut() {
    for (int b = 0; b < 256; ++b)
      for (int q = 0; q < 4; ++q) {
        const int c = (b >> (2 * q)) & 3;
        v[b][q] = c == 1 ? T(1) : c == 2 ? T(-1) : T(0);
      }
  }
};

// AVX-512 kernels (terngrad_avx512.cpp), usable when avx512_usable() is true.
bool avx512_usable();

// Error feedback fused into the ternarizer: it codes x + r_in (r_in may be null: x alone) and writes the residual
// r_out = (x + r_in) - s * b (r_out may alias r_in), each rounded to the element type as the scalar path rounds
// them. Pointers in the tensor's element type, as x: at the range's first element.
struct Feedback {
  const void* r_in;
  void* r_out;
};

// Elements [b, e), b and e multiples of 64, element i with scalers[i / block] (block a power of two >= 64), read at
// x[i - b]; writes bytes b/4 .. e/4 of out. fb fuses error feedback.
void ternarize_avx512(int dtype, const void* x, int64_t b, int64_t e, const float* scalers, int64_t block,
                      const Key& key, uint8_t* out, const Feedback* fb = nullptr);

// Statistics of elements [0, n) of the block starting at x (any n), shifted by x0.
// With r (fp32 only): of x + r, each sum rounded to fp32.
StatPartial stats_block_avx512(int dtype, const void* x, int64_t n, double x0, const float* r = nullptr);

// Decode elements [start, start + len), start and len multiples of 64, into out; nranks <= 127 when shared.
// ORs 1 into bad when a code is 0b11.
void decode_avx512(int nranks, const uint8_t* const* codes, const float* weights, int shared, float post,
                   int64_t start, int64_t len, float* out, uint32_t& bad);

// max|x| (NaN ignored) of each block of `block` fp32 elements starting in [lo, hi) (lo a multiple of block) into
// out[lo / block ..].
// With r: of x + r.
void block_max_f32_avx512(const float* x, int64_t lo, int64_t hi, int64_t n, int64_t block, double* out,
                          const float* r = nullptr);

// An owner's sums (tg_sum_shards) of code bytes [b0, b0 + nbytes), nbytes a multiple of 16, for nranks <= 127
// (bits 4 or 8), written at their place in out; ORs 1 into bad when a code is 0b11.
void sum_shards_avx512(int nranks, const uint8_t* const* shards, int64_t b0, int64_t nbytes, int bits, uint8_t* out,
                       uint32_t& bad);

}  // namespace tg
