// hvd_terngrad CPU kernels: a plain C ABI (no Python, no torch headers).
//
// Why a plain C ABI loaded by ctypes (the bitsandbytes pattern) rather than pybind11 or a torch extension:
// the library does not link against libtorch or libpython, so one build works with any torch and any
// Python 3 (no ABI breaks on torch upgrades, no C++17/torch header coupling as Horovod suffers), the same
// entry points can be called from C, Rust or Julia, and a ctypes call costs about a microsecond, which
// is nothing next to a kernel that reads megabytes. Tensors cross the boundary as data pointers.
//
// The wire format these kernels implement is docs/wire-format.md; reference.py is its executable spec.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TG_ABI_VERSION 7

// Input element types.
enum { TG_F32 = 0, TG_F64 = 1, TG_F16 = 2, TG_BF16 = 3 };

// Return codes.
enum { TG_OK = 0, TG_EINVAL = -1, TG_EDTYPE = -2 };

int tg_abi_version(void);

// Which SIMD path the kernels use on this CPU: 0 scalar, 2 AVX2, 3 AVX-512 (F/BW/VL/DQ + BMI2).
int tg_simd_level(void);

// Cap the SIMD level (for tests and benchmarks); returns the level now in use.
int tg_set_simd_level(int max_level);

// Statistics pass, one read of x. out = {mean, std about the mean (population), max|x|, #non-finite}.
// Deterministic: the summation order is fixed by 65536-element blocks and 8 lanes, whatever nthreads is.
int tg_stats(int dtype, const void* x, int64_t n, int nthreads, double out[4]);

// Fused stochastic ternarization and packing, one read of x and one write of ceil(n/4) bytes.
// Element i: h = 16-bit half (i % 2) of Philox word (i % 8) / 2 of block j = i / 8;
// t = fl(float(2h + 1) * fl(scaler * 2^-17)) in fp32; code = t < |float(x_i)| ? (x_i < 0 ? 0b10 : 0b01) : 0b00;
// code at bits 2*(i%4) of byte i/4; padding codes are 0.
// Philox4x32-10 key = (seed lo, seed hi), counter = (j lo, (j hi & 0xffff) | rank << 16, tensor_id, step).
// rank must be < 65536 and n < 2^50.
int tg_ternarize_pack(int dtype, const void* x, int64_t n, float scaler, uint64_t seed, uint32_t step,
                      uint32_t rank, uint32_t tensor_id, uint8_t* out, int nthreads);

// Unpack-and-accumulate decode of nranks code arrays into out[0..n) (fp32), no per-rank float array.
// shared != 0: out = (sum_r b_r) * (scalers[0] / nranks)            (one multiply per element)
// shared == 0: out = sum_r b_r * (scalers[r] / nranks), in rank order (fp32)
// Returns TG_OK, 1 if any code is the invalid 0b11 or a padding code is not 0, or a negative error.
int tg_decode_sum(int nranks, const uint8_t* const* codes, const float* scalers, int shared, int64_t n,
                  float* out, int nthreads);

// Block scalers (wire format version 2): element i is coded with scalers[i / block], block a power of two
// in [64, 2^30]. Otherwise as tg_ternarize_pack, whose codes these are when every block has the same scaler.
int tg_ternarize_pack_blocks(int dtype, const void* x, int64_t n, const float* scalers, int64_t block, uint64_t seed,
                             uint32_t step, uint32_t rank, uint32_t tensor_id, uint8_t* out, int nthreads);

// tg_decode_sum with one scaler per block: rank r's block k has scalers[r * nblocks + k] (shared: scalers[k]
// for every rank), nblocks = ceil(n / block).
int tg_decode_sum_blocks(int nranks, const uint8_t* const* codes, const float* scalers, int shared, int64_t n,
                         int64_t block, float* out, int nthreads);

// Error feedback fused into the coding (docs/wire-format.md, section 13). x = g + r (r may be NULL: x = g), the
// sum rounded to the element type as torch rounds a sum of two tensors of that type, is never stored whole.
// Codes as tg_ternarize_pack_blocks of x (block = 0: one scaler, scalers[0]). With r_out (required with r), also
// the residual r_out = x - fl_T(s_i * b_i), b_i the code's value and s_i its scaler (r_out may alias r).
int tg_ternarize_pack_feedback(int dtype, const void* g, const void* r, int64_t n, const float* scalers, int64_t block,
                               uint64_t seed, uint32_t step, uint32_t rank, uint32_t tensor_id, uint8_t* out,
                               void* r_out, int nthreads);

// tg_stats (block = 0) or tg_stats_blocks of x = g + r, r as in tg_ternarize_pack_feedback.
int tg_stats_feedback(int dtype, const void* g, const void* r, int64_t n, int64_t block, int nthreads, double out[4],
                      double* block_max);

// Per block of `block` elements, max|x| with NaN ignored, exact in double: out[ceil(n / block)].
int tg_block_absmax(int dtype, const void* x, int64_t n, int64_t block, double* out, int nthreads);

// tg_stats and tg_block_absmax from one read of x (a block is read again while it is in cache).
int tg_stats_blocks(int dtype, const void* x, int64_t n, int64_t block, int nthreads, double out[4],
                    double* block_max);

// Sharded transport, an owner's step (docs/wire-format.md, section 10): the per-element sums over nranks
// shards of shard_bytes packed codes, written as sum + nranks in 4, 8 or 16 bits (nranks <= 7, 127, 32767),
// little-endian, into out (shard_bytes * bits / 2 bytes). Returns TG_OK, 1 if a code is the invalid 0b11.
int tg_sum_shards(int nranks, const uint8_t* const* shards, int64_t shard_bytes, uint8_t* out, int nthreads);

// Elements [start, start + n) of a stream of packed sums (start a multiple of 4) as fp32 means:
// out = fl32(float(sum) * fl32(scaler / nranks)), the shared-scaler decode.
int tg_decode_packed_sums(const uint8_t* packed, int nranks, int64_t start, int64_t n, float scaler, float* out,
                          int nthreads);

// The 16-bit wire of an uncoded average (docs/wire-format.md, section 9): out[i] = fp16(fl32(x[i] * scale)),
// rounded to nearest even with subnormals kept, as torch converts (a NaN stays a NaN; its payload may not).
int tg_to_half(const float* x, int64_t n, float scale, uint16_t* out, int nthreads);

// And back: *absmax = max |fl32(float(h[i]) * scale)|, NaN where some h[i] is NaN, and where out is not NULL,
// out[i] = fl32(float(h[i]) * scale); with only_finite, out is written only where *absmax is finite.
int tg_from_half(const uint16_t* h, int64_t n, float scale, float* out, int only_finite, double* absmax, int nthreads);

// A group of k tensors back to back in one fp16 buffer: tg_to_half of each (xs[j], ns[j], scales[j]) into out
// after the ones before it, and tg_from_half of each slice of h into outs[j] (outs, or an outs[j], may be NULL)
// with its largest |value| in absmax[j]. One call a group, the same bits as one call a tensor.
int tg_to_half_group(int k, const float* const* xs, const int64_t* ns, const float* scales, uint16_t* out,
                     int nthreads);
int tg_from_half_group(int k, const uint16_t* h, const int64_t* ns, const float* scales, float* const* outs,
                       int only_finite, double* absmax, int nthreads);

// The fp32 wire of an uncoded average, scaled before its Sum: x[i] = fl32(x[i] * scale) in place, as torch's
// x.mul_(scale) with scale in fp32, and *absmax = the largest |x[i]| after, NaN where x holds one. One pass where
// torch takes two (the multiply, then a read of the largest or a sum).
int tg_scale(float* x, int64_t n, float scale, double* absmax, int nthreads);

// One Philox4x32-10 block, exposed for known-answer tests.
void tg_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

#ifdef __cplusplus
}
#endif
