// Runs the GPU kernels of hvd_terngrad/codec/terngrad_kernels.cu on the host, thread by thread, so that
// machines without a GPU still check their bytes against the reference. Built by tests/test_cuda_emulated.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct tg_dim3 { unsigned x = 0; };
static tg_dim3 blockIdx, threadIdx, blockDim;
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __double2float_rn(double d) { return (float)d; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline int atomicOr(int* p, int v) { const int o = *p; *p |= v; return o; }
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p; *p = v > o ? v : o; return o;
}
static inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
static inline void __syncthreads() {}
using std::min;

#include "../../hvd_terngrad/codec/terngrad_kernels.cu"

static void grid(long long threads, void (*body)(void*), void* arg) {
  blockDim.x = 256;
  for (long long t = 0; t < threads; ++t) {
    blockIdx.x = (unsigned)(t / 256);
    threadIdx.x = (unsigned)(t % 256);
    body(arg);
  }
}

struct TernArgs { int dt; const void* x; long long n; float s17; unsigned k0, k1, c1, tid, step; unsigned char* out; };
static void tern_body(void* p) {
  auto* a = static_cast<TernArgs*>(p);
  switch (a->dt) {
    case 0: tg_ternarize_pack_f32((const float*)a->x, a->n, a->s17, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
    case 1: tg_ternarize_pack_f64((const double*)a->x, a->n, a->s17, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
    case 2: tg_ternarize_pack_f16((const tg_f16*)a->x, a->n, a->s17, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
    case 3: tg_ternarize_pack_bf16((const tg_bf16*)a->x, a->n, a->s17, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
  }
}

struct DecArgs { const unsigned long long* codes; int nranks; const float* w; long long nblocks, block; int shared; long long n; float* out; int* bad; };
static void dec_body(void* p) {
  auto* a = static_cast<DecArgs*>(p);
  tg_decode_sum(a->codes, a->nranks, a->w, a->nblocks, a->block, a->shared, a->n, a->out, a->bad);
}

struct BlkArgs { int dt; const void* x; long long n; const float* scalers; long long block; unsigned k0, k1, c1, tid, step; unsigned char* out; };
static void blk_body(void* p) {
  auto* a = static_cast<BlkArgs*>(p);
  switch (a->dt) {
    case 0: tg_ternarize_pack_blocks_f32((const float*)a->x, a->n, a->scalers, a->block, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
    case 1: tg_ternarize_pack_blocks_f64((const double*)a->x, a->n, a->scalers, a->block, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
    case 2: tg_ternarize_pack_blocks_f16((const tg_f16*)a->x, a->n, a->scalers, a->block, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
    case 3: tg_ternarize_pack_blocks_bf16((const tg_bf16*)a->x, a->n, a->scalers, a->block, a->k0, a->k1, a->c1, a->tid, a->step, a->out); break;
  }
}

struct MaxArgs { int dt; const void* x; const void* r; long long n, block; unsigned long long* out; };
static void max_body(void* p) {
  auto* a = static_cast<MaxArgs*>(p);
  switch (a->dt) {
    case 0: tg_block_absmax_f32((const float*)a->x, (const float*)a->r, a->n, a->block, a->out); break;
    case 1: tg_block_absmax_f64((const double*)a->x, (const double*)a->r, a->n, a->block, a->out); break;
    case 2: tg_block_absmax_f16((const tg_f16*)a->x, (const tg_f16*)a->r, a->n, a->block, a->out); break;
    case 3: tg_block_absmax_bf16((const tg_bf16*)a->x, (const tg_bf16*)a->r, a->n, a->block, a->out); break;
  }
}

struct FbArgs { int dt; const void* x; const void* r; long long n; const float *s2m17, *scalers; long long block;
                unsigned k0, k1, c1, tid, step; unsigned char* out; void* r_out; };
static void fb_body(void* p) {
  auto* a = static_cast<FbArgs*>(p);
#define TG_FB(T, F) F((const T*)a->x, (const T*)a->r, a->n, a->s2m17, a->scalers, a->block, a->k0, a->k1, a->c1, \
                      a->tid, a->step, a->out, (T*)a->r_out)
  switch (a->dt) {
    case 0: TG_FB(float, tg_ternarize_pack_feedback_f32); break;
    case 1: TG_FB(double, tg_ternarize_pack_feedback_f64); break;
    case 2: TG_FB(tg_f16, tg_ternarize_pack_feedback_f16); break;
    case 3: TG_FB(tg_bf16, tg_ternarize_pack_feedback_bf16); break;
  }
#undef TG_FB
}

struct SumArgs { const unsigned long long* shards; int nranks; long long shard_bytes; int bits; unsigned char* out; int* bad; };
static void sum_body(void* p) {
  auto* a = static_cast<SumArgs*>(p);
  tg_sum_shards(a->shards, a->nranks, a->shard_bytes, a->bits, a->out, a->bad);
}

struct PackedArgs { const unsigned char* packed; int nranks, bits; long long start, n; float post; float* out; };
static void packed_body(void* p) {
  auto* a = static_cast<PackedArgs*>(p);
  tg_decode_packed_sums(a->packed, a->nranks, a->bits, a->start, a->n, a->post, a->out);
}

extern "C" {
int emu_sum_shards(const unsigned long long* shards, int nranks, long long shard_bytes, int bits, unsigned char* out) {
  int bad = 0;
  SumArgs a{shards, nranks, shard_bytes, bits, out, &bad};
  grid((shard_bytes + 255) / 256 * 256, sum_body, &a);
  return bad;
}
void emu_decode_packed_sums(const unsigned char* packed, int nranks, int bits, long long start, long long n, float post,
                            float* out) {
  PackedArgs a{packed, nranks, bits, start, n, post, out};
  grid((n + 255) / 256 * 256, packed_body, &a);
}
void emu_ternarize(int dt, const void* x, long long n, float s17, unsigned k0, unsigned k1, unsigned c1, unsigned tid,
                   unsigned step, unsigned char* out) {
  TernArgs a{dt, x, n, s17, k0, k1, c1, tid, step, out};
  const long long nblk = (n + 7) / 8;
  grid((nblk + 255) / 256 * 256, tern_body, &a);
}
void emu_ternarize_blocks(int dt, const void* x, long long n, const float* scalers, long long block, unsigned k0,
                          unsigned k1, unsigned c1, unsigned tid, unsigned step, unsigned char* out) {
  BlkArgs a{dt, x, n, scalers, block, k0, k1, c1, tid, step, out};
  const long long nblk = (n + 7) / 8;
  grid((nblk + 255) / 256 * 256, blk_body, &a);
}
void emu_ternarize_feedback(int dt, const void* x, const void* r, long long n, const float* s2m17,
                            const float* scalers, long long block, unsigned k0, unsigned k1, unsigned c1, unsigned tid,
                            unsigned step, unsigned char* out, void* r_out) {
  FbArgs a{dt, x, r, n, s2m17, scalers, block, k0, k1, c1, tid, step, out, r_out};
  const long long nblk = (n + 7) / 8;
  grid((nblk + 255) / 256 * 256, fb_body, &a);
}
void emu_block_absmax(int dt, const void* x, const void* r, long long n, long long block, unsigned long long* out) {
  MaxArgs a{dt, x, r, n, block, out};
  const long long nblk = (n + 7) / 8;
  grid((nblk + 255) / 256 * 256, max_body, &a);
}
int emu_decode(const unsigned long long* codes, int nranks, const float* w, long long nblocks, long long block,
               int shared, long long n, float* out) {
  int bad = 0;
  DecArgs a{codes, nranks, w, nblocks, block, shared, n, out, &bad};
  const long long nbytes = (n + 3) / 4;
  grid((nbytes + 255) / 256 * 256, dec_body, &a);
  return bad;
}
}
