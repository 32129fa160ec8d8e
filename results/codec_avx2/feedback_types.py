"""The fused error feedback's cost for each element type: ternarize + EF against the plain ternarize, 16M
elements, one thread, at the machine's SIMD level (medians of 7 rounds, each call timed over >= 1 s).

    PYTHONPATH=. python results/codec_avx2/feedback_types.py > results/codec_avx2/feedback_types.txt
    PYTHONPATH=. python results/codec_avx2/feedback_types.py 2     # the SIMD level capped at 2 (cpu.set_simd_level)
"""
import platform
import statistics
import sys

import torch

from benchmarks.codec_bench import cpu_name, timeit
from hvd_terngrad import codec
from hvd_terngrad.codec import cpu

n = 1 << 24
if len(sys.argv) > 1:
    cpu.set_simd_level(int(sys.argv[1]))


def pair(x: torch.Tensor, r: torch.Tensor, s: float) -> tuple[float, float]:
    """Seconds a call: the plain ternarize, then the same with the residual fed back in place."""
    key = codec.RngKey(1, 2, 3, 4)
    out = torch.empty(n // 4, dtype=torch.uint8)
    a = timeit(lambda: codec.ternarize_pack(x, s, key, out=out, backend="cpu", nthreads=1), min_time=1.0)
    b = timeit(lambda: codec.ternarize_pack(x, s, key, out=out, residual=r, residual_out=r, backend="cpu",
                                            nthreads=1), min_time=1.0)
    return a, b


res = {}
for rep in range(7):
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        g = torch.Generator().manual_seed(rep)
        x = (torch.randn(n, generator=g) * 0.01).to(dt)
        r = (torch.randn(n, generator=g) * 0.002).to(dt)
        s = float(x.abs().max())
        res.setdefault(str(dt).replace("torch.", ""), []).append(pair(x, r, s))
print(f"{cpu_name()}, SIMD level {cpu.simd_level()}, torch {torch.__version__}, {platform.python_version()}")
print("| dtype | ternarize ms | + EF ms | EF cost (median of the rounds' ratios) | range |")
print("|---|---:|---:|---:|---|")
for k, v in res.items():
    a = statistics.median(t[0] for t in v)
    b = statistics.median(t[1] for t in v)
    q = sorted(t[1] / t[0] for t in v)
    print(f"| {k} | {a * 1e3:.2f} | {b * 1e3:.2f} | {statistics.median(q):.2f}x | {q[0]:.2f}-{q[-1]:.2f} |")
