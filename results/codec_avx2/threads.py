"""Each multi-threaded codec kernel with 1 and 2 threads (medians of 3 x 30 calls), 256K to 16M fp32 elements.

    PYTHONPATH=. python results/codec_avx2/threads.py > results/codec_avx2/threads.txt

Each column: ms with 1 thread / ms with 2 = the speed-up of the second thread.
"""
import statistics
import time

import torch

from hvd_terngrad import codec
from hvd_terngrad.codec import cpu


def median_ms(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def kernels(n: int) -> dict:
    x, r = torch.randn(n) * 0.01, torch.randn(n) * 0.002
    s, key = float(x.abs().max()), codec.RngKey(1, 2, 3, 4)
    out, absmax, dec = torch.empty(n // 4, dtype=torch.uint8), torch.empty(n // 64, dtype=torch.float64), torch.empty(n)
    codes = [codec.ternarize_pack(x, s, codec.RngKey(1, 2, q, 4)) for q in range(4)]
    return {
        "stats": lambda nt: cpu.moments(x, nt),
        "stats_r_b64": lambda nt: cpu.moments_blocks(x, 64, absmax, nt, r),
        "absmax": lambda nt: cpu.block_absmax(x, 64, absmax, nt),
        "tern": lambda nt: codec.ternarize_pack(x, s, key, out=out, backend="cpu", nthreads=nt),
        "tern_ef": lambda nt: codec.ternarize_pack(x, s, key, out=out, residual=r, residual_out=r, backend="cpu",
                                                   nthreads=nt),
        "decode4": lambda nt: codec.decode_mean(codes, [s] * 4, True, n, out=dec, backend="cpu", nthreads=nt),
    }


def main() -> None:
    print(f"SIMD level {cpu.simd_level()}")
    for n in (1 << 18, 1 << 19, 1 << 20, 1 << 22, 1 << 24):
        line = []
        for name, fn in kernels(n).items():
            one = statistics.median(median_ms(lambda fn=fn: fn(1)) for _ in range(3))
            two = statistics.median(median_ms(lambda fn=fn: fn(2)) for _ in range(3))
            line.append(f"{name} {one:.3f}/{two:.3f}={one / two:.2f}x")
        print(f"{n >> 10}K" if n < 1 << 20 else f"{n >> 20}M", " ".join(line), flush=True)


if __name__ == "__main__":
    main()
