// The sharded transport's two kernels (docs/wire-format.md, section 10): an owner's fused sum and pack of
// the N ranks' code shards, and the fused unpack and decode of the packed sums into fp32 means.
//
// Both work in blocks that keep their int16 accumulators in L1. The sums are small integers, so no rounding
// order is at stake: up to 127 ranks, AVX-512 adds 64 codes a rank at a time into int8 counters (masks from
// pext, as the decode); otherwise, and for the last bytes, plain loops over bytes.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "terngrad.h"
#include "terngrad_internal.h"

namespace {

int sum_bits(int nranks) {
  for (int bits : {4, 8, 16})
    if (2 * nranks < (1 << bits)) return bits;
  return 0;
}

template <class F>
void for_blocks(int64_t nblocks, int nthreads, F&& f) {
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(nthreads, nblocks));
  if (nt == 1) {
    for (int64_t b = 0; b < nblocks; ++b) f(b);
    return;
  }
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < nt; ++t)
    pool.emplace_back([&] {
      for (int64_t b; (b = next.fetch_add(1)) < nblocks;) f(b);
    });
  for (int64_t b; (b = next.fetch_add(1)) < nblocks;) f(b);
  for (auto& th : pool) th.join();
}

const tg::CodeLut<int8_t> kSumLut;

constexpr int64_t kBlockBytes = 2048;  // code bytes per block: 8192 int16 sums

}  // namespace

extern "C" {

int tg_sum_shards(int nranks, const uint8_t* const* shards, int64_t shard_bytes, uint8_t* out, int nthreads) {
  const int bits = sum_bits(nranks);
  if (nranks <= 0 || bits == 0 || shard_bytes < 0 || !shards || (shard_bytes > 0 && !out)) return TG_EINVAL;
  for (int r = 0; r < nranks; ++r)
    if (!shards[r]) return TG_EINVAL;
  const int64_t nblocks = (shard_bytes + kBlockBytes - 1) / kBlockBytes;
  std::atomic<uint32_t> bad_all{0};
  // AVX-512: int8 counters, so up to 127 ranks (4- and 8-bit sums); whole 16-byte groups, the rest below.
  const bool simd = tg_simd_level() >= 3 && bits <= 8;
  for_blocks(nblocks, shard_bytes >= (int64_t(1) << 16) ? nthreads : 1, [&](int64_t blk) {
    alignas(64) int16_t acc[4 * kBlockBytes];
    int64_t b0 = blk * kBlockBytes, nb = std::min(kBlockBytes, shard_bytes - b0);
    uint32_t bad = 0;
    if (simd) {
      const int64_t full = nb / 16 * 16;
      tg::sum_shards_avx512(nranks, shards, b0, full, bits, out, bad);
      b0 += full;
      nb -= full;
    }
    std::memset(acc, 0, sizeof(int16_t) * 4 * nb);
    for (int r = 0; r < nranks; ++r) {
      const uint8_t* c = shards[r] + b0;
      for (int64_t k = 0; k < nb; ++k) {
        const uint8_t byte = c[k];
        bad |= byte & (byte >> 1) & 0x55u;
        for (int q = 0; q < 4; ++q) acc[4 * k + q] += kSumLut.v[byte][q];
      }
    }
    const int64_t n = 4 * nb;
    if (bits == 4) {
      uint8_t* o = out + b0 * 2;
      for (int64_t k = 0; k < n; k += 2)
        o[k / 2] = (uint8_t)((acc[k] + nranks) | (acc[k + 1] + nranks) << 4);
    } else if (bits == 8) {
      uint8_t* o = out + b0 * 4;
      for (int64_t k = 0; k < n; ++k) o[k] = (uint8_t)(acc[k] + nranks);
    } else {
      uint8_t* o = out + b0 * 8;
      for (int64_t k = 0; k < n; ++k) {
        const uint32_t v = (uint32_t)(acc[k] + nranks);
        o[2 * k] = (uint8_t)(v & 0xff);
        o[2 * k + 1] = (uint8_t)(v >> 8);
      }
    }
    if (bad) bad_all |= bad;
  });
  return bad_all.load() ? 1 : TG_OK;
}

int tg_decode_packed_sums(const uint8_t* packed, int nranks, int64_t start, int64_t n, float scaler, float* out,
                          int nthreads) {
  const int bits = sum_bits(nranks);
  if (nranks <= 0 || bits == 0 || start < 0 || start % 4 || n < 0 || (n > 0 && (!packed || !out))) return TG_EINVAL;
  const float post = scaler / (float)nranks;
  const int64_t block = 4 * kBlockBytes;
  const int64_t nblocks = (n + block - 1) / block;
  for_blocks(nblocks, n >= (int64_t(1) << 18) ? nthreads : 1, [&](int64_t blk) {
    const int64_t b = blk * block, e = std::min(n, b + block);
    float* o = out + b;
    const int64_t i0 = start + b;  // element index in the stream of sums; even, since start and b are
    if (bits == 4) {
      const uint8_t* p = packed + i0 / 2;
      const int64_t pairs = (e - b) / 2;
      for (int64_t j = 0; j < pairs; ++j) {  // a byte holds two sums, low nibble first
        o[2 * j] = (float)((int)(p[j] & 15) - nranks) * post;
        o[2 * j + 1] = (float)((int)(p[j] >> 4) - nranks) * post;
      }
      if ((e - b) & 1) o[e - b - 1] = (float)((int)(p[pairs] & 15) - nranks) * post;
    } else if (bits == 8) {
      const uint8_t* p = packed + i0;
      for (int64_t k = 0; k < e - b; ++k) o[k] = (float)((int)p[k] - nranks) * post;
    } else {
      const uint8_t* p = packed + 2 * i0;
      for (int64_t k = 0; k < e - b; ++k) o[k] = (float)((int)(p[2 * k] | p[2 * k + 1] << 8) - nranks) * post;
    }
  });
  return TG_OK;
}

}  // extern "C"
