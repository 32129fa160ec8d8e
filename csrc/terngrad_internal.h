// Internal declarations shared by the CPU translation units (not part of the C ABI).
#pragma once
#include <stdint.h>

namespace tg {

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

// Error feedback fused into the fp32 ternarizer: it codes x + r_in (r_in may be null: x alone) and writes the
// residual r_out = (x + r_in) - s * b (r_out may alias r_in). Pointers as x: at the range's first element.
struct Feedback {
  const float* r_in;
  float* r_out;
};

// Elements [b, e), b and e multiples of 64, element i with scalers[i / block] (block a power of two >= 64), read at
// x[i - b]; writes bytes b/4 .. e/4 of out. fb (fp32 only) fuses error feedback.
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
