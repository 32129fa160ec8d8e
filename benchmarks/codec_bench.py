"""Codec throughput, side by side in one run: GB/s of fp32 gradient, higher is better.

    python -m benchmarks.codec_bench [--sizes 1M,16M,64M] [--threads 1,2] [--simd scalar,avx2,avx512] [--json out.json]

Every table at each SIMD level asked for (default: every level the CPU has), one level after another in one run;
the header names the CPU.

Encode = ternarize + pack (the scaler given); stats is the separate statistics pass. Baselines:
- memcpy: a single-thread numpy copy of the same fp32 array (the memory-bound ceiling of one core);
- torch-ops: a GRACE-style codec in torch ops (flatten, std, clamp, rand, compare, sign, cast to int8),
  the usual way TernGrad is written in Python; it keeps one int8 per element (no 2-bit packing);
- numpy: a naive numpy ternarizer with 2-bit packing.
Decode = the average of 4 ranks' codes into one fp32 tensor (GB/s of fp32 output).
A second table times what the recommended configuration adds, one tensor through a rank's Coder (moments,
scalers, codes, residual) as the pipeline runs it: the paper's defaults, block scalers (64), error feedback,
and both (TernGradConfig.recommended()); the fused error-feedback kernel alone against ternarize_pack; and
error feedback written in torch ops around the plain kernels (how it was done before the fused kernels).
A third times the 16-bit wire of an uncoded average (transport="auto"'s fp16 plans, docs/wire-format.md section 9),
one tensor each way: the codec's pass (Codec.to_half; Codec.from_half, which takes the largest |value| too)
against the same in torch ops (a multiply into fp16; a multiply back and aminmax), beside Horovod's plain casts.
With a CUDA device (and CuPy) a GPU section adds the device-to-device copy and checks CPU/GPU bit identity.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from hvd_terngrad import codec
from hvd_terngrad.codec import cpu as cpu_backend

RANKS = 4


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def timeit(fn, min_time=0.3, min_reps=3, max_reps=50) -> float:
    fn()  # warm up
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        el = time.perf_counter() - t0
        if reps >= max_reps or (reps >= min_reps and el >= min_time):
            return el / reps


# ---------------------------------------------------------------------------------------------
def grace_compress(t: torch.Tensor):
    t = t.flatten()
    std = torch.sqrt(torch.mean((t - torch.mean(t)) ** 2))
    c = 2.5 * std.item()
    g = torch.clamp(t, -c, c)
    a = g.abs()
    scalar = a.max()
    sign = g.sign() * scalar
    rnd = torch.empty_like(t).uniform_(0, scalar.item())
    sign[rnd >= a] = 0
    return sign.sign().type(torch.int8), scalar


def grace_decode(codes: list[torch.Tensor], scalars: list[torch.Tensor]) -> torch.Tensor:
    out = codes[0].float() * scalars[0]
    for c, s in zip(codes[1:], scalars[1:]):
        out += c.float() * s
    return out / len(codes)


def numpy_encode(x: np.ndarray, s: float, rng: np.random.Generator) -> np.ndarray:
    p = np.abs(x) / s
    keep = rng.random(x.size, dtype=np.float32) < p
    codes = np.where(keep, np.where(x < 0, 2, 1), 0).astype(np.uint8)
    codes = np.concatenate([codes, np.zeros((-codes.size) % 4, np.uint8)]).reshape(-1, 4)
    return codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6


def numpy_decode(packed: list[np.ndarray], scalers: list[float], n: int) -> np.ndarray:
    out = np.zeros(n, np.float32)
    for p, s in zip(packed, scalers):
        c = np.stack([(p >> (2 * w)) & 3 for w in range(4)], axis=1).reshape(-1)[:n]
        out += ((c == 1).astype(np.float32) - (c == 2).astype(np.float32)) * np.float32(s)
    return out / len(packed)


# ---------------------------------------------------------------------------------------------
def cpu_rows(n: int, threads: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 0.01
    xa = x.numpy()
    ya = np.empty_like(xa)
    gb = 4 * n / 1e9
    t_memcpy = timeit(lambda: np.copyto(ya, xa))
    s = float(np.float32(2.5 * float(x.std())))
    key = codec.RngKey(1, 2, 3, 4)
    out = torch.empty((n + 3) // 4, dtype=torch.uint8)
    codes = [codec.ternarize_pack(x, s, codec.RngKey(1, 2, r, 4)) for r in range(RANKS)]
    dec = torch.empty(n, dtype=torch.float32)
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        t_enc = timeit(lambda nt=nt: codec.ternarize_pack(x, s, key, out=out, backend="cpu", nthreads=nt))
        t_stats = timeit(lambda nt=nt: codec.moments(x, backend="cpu", nthreads=nt))
        t_dec = timeit(lambda nt=nt: codec.decode_mean(codes, [s] * RANKS, True, n, out=dec, backend="cpu",
                                                       nthreads=nt))
        t_grace = timeit(lambda: grace_compress(x), min_reps=2, max_reps=5)
        gc = [grace_compress(x) for _ in range(RANKS)]
        t_grace_dec = timeit(lambda gc=gc: grace_decode([c for c, _ in gc], [v for _, v in gc]), min_reps=2,
                             max_reps=5)
        rows.append({"n": n, "threads": nt, "memcpy_1t": gb / t_memcpy, "encode": gb / t_enc, "stats": gb / t_stats,
                     "decode": gb / t_dec, "torch_ops_encode": gb / t_grace, "torch_ops_decode": gb / t_grace_dec})
    torch.set_num_threads(max(threads))
    rng = np.random.default_rng(0)
    t_np = timeit(lambda: numpy_encode(xa, s, rng), min_reps=1, max_reps=3, min_time=0.0)
    npc = [numpy_encode(xa, s, rng) for _ in range(RANKS)]
    t_np_dec = timeit(lambda: numpy_decode(npc, [s] * RANKS, n), min_reps=1, max_reps=3, min_time=0.0)
    for r in rows:
        r["numpy_encode"] = gb / t_np
        r["numpy_decode"] = gb / t_np_dec
    return rows


def _cuda_time(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _coder_encode(cfg, x: torch.Tensor) -> float:
    """Seconds of one tensor's encode through a Coder: prepare (moments, scalers) and code_into (codes, residual)."""
    from hvd_terngrad.coder import Coder
    from hvd_terngrad.wire import codes_size

    coder = Coder(cfg, 0, 2)
    codes = torch.empty(codes_size(x.numel()), dtype=torch.uint8)

    def once():
        coder.code_into(coder.prepare("w", x), codes)
        coder.next_step()

    once()  # the first step allocates the residual
    return timeit(once)


def _unfused_feedback(x, r, s, key, nt):
    """Error feedback around the plain kernels in torch ops: g + r, moments, codes, decode, s*b, new residual."""
    x2 = x + r
    codec.moments(x2, backend="cpu", nthreads=nt)
    codes = codec.ternarize_pack(x2, s, key, backend="cpu", nthreads=nt)
    b = codec.decode_mean([codes], [1.0], True, x.numel(), backend="cpu", nthreads=nt)
    return x2 - b * torch.tensor(s, dtype=torch.float32)


def feedback_rows(n: int, threads: list[int]) -> list[dict]:
    """Seconds per tensor of n fp32 elements: the encode of each configuration, and the kernels alone."""
    import dataclasses

    from hvd_terngrad import TernGradConfig

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g) * 0.01
    r = torch.randn(n, generator=g) * 0.002
    out = torch.empty((n + 3) // 4, dtype=torch.uint8)
    xa = x.numpy()
    ya = np.empty_like(xa)
    t_memcpy = timeit(lambda: np.copyto(ya, xa))
    s = float(np.float32(float(x.abs().max())))
    key = codec.RngKey(1, 2, 3, 4)
    rec = TernGradConfig.recommended()
    configs = {"paper": TernGradConfig(), "block64": TernGradConfig(block_size=64),
               "feedback": TernGradConfig(error_feedback=True), "recommended": rec}
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        row = {"n": n, "threads": nt, "memcpy_1t": t_memcpy}
        for name, cfg in configs.items():
            row[f"encode_{name}"] = _coder_encode(dataclasses.replace(cfg, num_threads=nt, backend="cpu"), x)
        row["ternarize"] = timeit(lambda nt=nt: codec.ternarize_pack(x, s, key, out=out, backend="cpu", nthreads=nt))
        rr = r.clone()
        row["ternarize_feedback"] = timeit(lambda nt=nt, rr=rr: codec.ternarize_pack(
            x, s, key, out=out, residual=rr, residual_out=rr, backend="cpu", nthreads=nt))
        row["encode_feedback_unfused"] = timeit(lambda nt=nt: _unfused_feedback(x, r, s, key, nt), max_reps=10)
        rows.append(row)
    torch.set_num_threads(max(threads))
    return rows


def half_rows(n: int, threads: list[int]) -> list[dict]:
    """Seconds per tensor of n fp32 elements on the 16-bit wire, each way: the kernels, torch's ops, the casts."""
    from hvd_terngrad.codec import reference

    x = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.01
    h, back = torch.empty(n, dtype=torch.float16), torch.empty(n)
    avg = (x * 2.0 ** 20).half()
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        c = codec.Codec("cpu", nt)
        rows.append({"n": n, "threads": nt,
                     "to_half": timeit(lambda c=c: c.to_half(x, 2.0 ** 20, out=h)),
                     "to_half_torch": timeit(lambda: reference.to_half(x, 2.0 ** 20, h)),
                     "cast_half": timeit(lambda: x.half()),
                     "from_half": timeit(lambda c=c: c.from_half(avg, 2.0 ** 20, out=back, only_finite=True)),
                     "from_half_torch": timeit(lambda: reference.from_half(avg, 2.0 ** 20, back, True)),
                     "cast_float": timeit(lambda: avg.float())})
    torch.set_num_threads(max(threads))
    return rows


def gpu_row(n: int) -> dict:
    x = torch.randn(n, device="cuda") * 0.01
    y = torch.empty_like(x)
    s = float(np.float32(2.5 * float(x.std())))
    key = codec.RngKey(1, 2, 3, 4)
    out = torch.empty((n + 3) // 4, dtype=torch.uint8, device="cuda")
    codes = [codec.ternarize_pack(x, s, codec.RngKey(1, 2, r, 4)) for r in range(RANKS)]
    dec = torch.empty(n, device="cuda")
    gb = 4 * n / 1e9
    t_copy = _cuda_time(lambda: y.copy_(x))
    t_enc = _cuda_time(lambda: codec.ternarize_pack(x, s, key, out=out, backend="cuda"))
    t_dec = _cuda_time(lambda: codec.decode_mean(codes, [s] * RANKS, True, n, out=dec, backend="cuda"))
    same = torch.equal(out.cpu(), codec.ternarize_pack(x.cpu(), s, key, backend="cpu"))
    dec_same = torch.equal(dec.cpu(), codec.decode_mean([c.cpu() for c in codes], [s] * RANKS, True, n, backend="cpu"))
    # GB/s of fp32 input, like the CPU rows (the copy itself moves twice that)
    return {"n": n, "d2d_copy": gb / t_copy, "encode": gb / t_enc, "decode": gb / t_dec,
            "encode_vs_copy": t_copy / t_enc, "codes_bit_identical_to_cpu": same,
            "decode_bit_identical_to_cpu": dec_same, "device": torch.cuda.get_device_name()}


def gpu_rows(sizes: list[int]) -> list[dict]:
    from hvd_terngrad.codec import cuda as cuda_backend

    if not (torch.cuda.is_available() and cuda_backend.available()):
        return []
    return [gpu_row(n) for n in sizes]


def fmt_size(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else str(n)


def _table(header: str, make_rows, sizes: list[int], threads: list[int], line) -> list[dict]:
    """A markdown table printed as it is measured: line(row) for every row of make_rows(n, threads), every n."""
    print(header)
    print("|---:" * (header.count("|") - 1) + "|")
    rows = []
    for n in sizes:
        for r in make_rows(n, threads):
            rows.append(r)
            print(line(r), flush=True)
    return rows


def _tables(sizes: list[int], threads: list[int]) -> tuple[list, list, list]:
    """The three tables at the SIMD level in use: throughput, what the recommended configuration adds, the 16-bit
    wire."""
    print("GB/s of fp32 gradient (decode: of fp32 output, average of 4 ranks); ratios are ours / baseline\n")
    rows = _table(("| n | threads | memcpy 1t | encode | stats | decode | torch-ops enc | torch-ops dec | numpy enc | "
                   "numpy dec | enc/memcpy | stats/memcpy | enc/torch-ops | dec/torch-ops |"), cpu_rows, sizes, threads,
                  lambda r: (
        f"| {fmt_size(r['n'])} | {r['threads']} | {r['memcpy_1t']:.2f} | {r['encode']:.2f} | {r['stats']:.2f} | "
        f"{r['decode']:.2f} | {r['torch_ops_encode']:.3f} | {r['torch_ops_decode']:.3f} | "
        f"{r['numpy_encode']:.3f} | {r['numpy_decode']:.3f} | {r['encode'] / r['memcpy_1t']:.2f}x | "
        f"{r['stats'] / r['memcpy_1t']:.2f}x | {r['encode'] / r['torch_ops_encode']:.0f}x | "
        f"{r['decode'] / r['torch_ops_decode']:.0f}x |"))
    print("\nWhat the recommended configuration adds: ms per tensor of n fp32 elements through a rank's Coder "
          "(moments, scalers, codes, residual);\n'unfused' is error feedback in torch ops around the plain kernels, "
          "as before the fused ones; EF = error feedback\n")

    def feedback_line(r):
        ms = {k: 1e3 * v for k, v in r.items() if k not in ("n", "threads")}
        return (f"| {fmt_size(r['n'])} | {r['threads']} | {ms['memcpy_1t']:.2f} | {ms['encode_paper']:.2f} | "
                f"{ms['encode_block64']:.2f} | {ms['encode_feedback']:.2f} | {ms['encode_feedback_unfused']:.1f} | "
                f"{ms['encode_recommended']:.2f} | {r['encode_feedback'] / r['encode_paper']:.2f}x | "
                f"{r['encode_recommended'] / r['encode_block64']:.2f}x | {ms['ternarize']:.2f} | "
                f"{ms['ternarize_feedback']:.2f} | {r['ternarize_feedback'] / r['ternarize']:.2f}x |")

    fb_rows = _table(("| n | threads | memcpy 1t | paper | block 64 | EF | EF unfused | recommended | EF/paper | "
                      "recommended/block 64 | kernel: ternarize | ternarize+EF | EF cost |"), feedback_rows, sizes,
                     threads, feedback_line)
    print("\nThe 16-bit wire of an uncoded average: ms per tensor of n fp32 elements, each way; 'torch' is the "
          "same in torch ops,\n'cast' Horovod's Compression.fp16 (a plain cast, no scale and no largest value)\n")

    def half_line(r):
        ms = {k: 1e3 * v for k, v in r.items() if k not in ("n", "threads")}
        return (f"| {fmt_size(r['n'])} | {r['threads']} | {ms['to_half']:.3f} | {ms['to_half_torch']:.3f} | "
                f"{ms['cast_half']:.3f} | {ms['from_half']:.3f} | {ms['from_half_torch']:.3f} | "
                f"{ms['cast_float']:.3f} | "
                f"{r['to_half_torch'] / r['to_half']:.1f}x | {r['from_half_torch'] / r['from_half']:.1f}x |")

    half = _table(("| n | threads | to fp16 | torch | cast | back, with the largest | torch | cast | to: torch/ours | "
                   "back: torch/ours |"), half_rows, sizes, threads, half_line)
    return rows, fb_rows, half


def cpu_name() -> str:
    """The CPU's model name and widest SIMD extension (speed figures differ between machines of one kind)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"{model}, {'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}"


def simd_levels(spec: str | None) -> list[int]:
    """The SIMD levels to run: names or numbers from spec, or every level this CPU has (None)."""
    top = cpu_backend.set_simd_level(3)
    names = {v: k for k, v in cpu_backend.SIMD_LEVELS.items()}
    if spec is None:
        return [lvl for lvl in sorted(cpu_backend.SIMD_LEVELS) if lvl <= top]
    levels = []
    for part in spec.split(","):
        part = part.strip()
        lvl = names.get(part, int(part) if part.isdigit() else None)
        if lvl not in cpu_backend.SIMD_LEVELS:
            raise SystemExit(f"--simd: unknown level {part!r}; allowed: {', '.join(names)}")
        if lvl > top:
            print(f"--simd: {part} is not on this CPU (its level is {cpu_backend.SIMD_LEVELS[top]}); left out")
            continue
        levels.append(lvl)
    return levels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    ap.add_argument("--simd", default=None, help="comma-separated SIMD levels, side by side in one run: scalar, "
                                                 "avx2, avx512 (default: every level this CPU has)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    allt = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, allt})
    levels = simd_levels(args.simd)
    print(f"hvd_terngrad codec benchmark: {cpu_name()}, {allt} cores, SIMD levels "
          f"{', '.join(cpu_backend.SIMD_LEVELS[lvl] for lvl in levels)}, torch {torch.__version__}, "
          f"numpy {np.__version__}")
    rows, fb_rows, half = [], [], []
    try:
        for lvl in levels:
            assert cpu_backend.set_simd_level(lvl) == lvl
            print(f"\n## SIMD level {lvl} ({cpu_backend.SIMD_LEVELS[lvl]})\n")
            for table, got in zip((rows, fb_rows, half), _tables(sizes, threads)):
                table += [{"simd": cpu_backend.SIMD_LEVELS[lvl], **r} for r in got]
    finally:
        cpu_backend.set_simd_level(3)
    g = gpu_rows(sizes)
    if g:
        print(f"\nGPU: {g[0]['device']}")
        print("| n | d2d copy | encode | decode | encode/copy | codes = CPU | decode = CPU |")
        print("|---:|---:|---:|---:|---:|---|---|")
        for r in g:
            print(f"| {fmt_size(r['n'])} | {r['d2d_copy']:.1f} | {r['encode']:.1f} | {r['decode']:.1f} | "
                  f"{r['encode_vs_copy']:.2f}x | {r['codes_bit_identical_to_cpu']} | "
                  f"{r['decode_bit_identical_to_cpu']} |")
    else:
        print("\nGPU: no CUDA device with CuPy here; the GPU rows need a machine with one.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": rows, "feedback_seconds": fb_rows, "half_seconds": half, "gpu": g}, f, indent=1)


if __name__ == "__main__":
    main()
