"""What one allreduce of n gradients costs in each dtype a 16-bit wire could use, on torch.distributed's gloo and
on Horovod, side by side in one job: whether half the bytes halve the time, or a 16-bit sum costs it back.

    python -m benchmarks.cluster run --nodes 4 --profile ethernet-1g -- python -m benchmarks.allreduce_dtypes

The default n is NCF's 102,305 gradients (benchmarks.fidelity_suite), whose DDP steps at 1 Gbit/s gained little
from 16 bits (docs/notes/tta-history.md, "NCF at 1 Gbit/s on fresh seeds"). Each (library, dtype) runs --reps
allreduces after a barrier each, in --rounds rounds that take the kinds in turn, so that the machine's drift falls
on every kind alike; rank 0 prints each round's median, in ms. Horovod's allreduce takes no bf16.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.cluster import init_gloo

KINDS = (("gloo", "float32"), ("gloo", "float16"), ("gloo", "bfloat16"), ("horovod", "float32"),
         ("horovod", "float16"))


def median_ms(library: str, dtype: str, numel: int, reps: int) -> float:
    """The median seconds (in ms) of `reps` allreduces of `numel` values in `dtype`, a barrier before each."""
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    t = torch.randn(numel).to(getattr(torch, dtype))
    times = []
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if library == "gloo":
            dist.all_reduce(t)
        else:
            hvd.allreduce(t, name=f"allreduce_dtypes.{dtype}.{i}")
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=102_305)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, help="the gloo group's (default: MASTER_PORT, else 29533)")
    args = ap.parse_args(argv)

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    hvd.init()
    torch.set_num_threads(1)
    init_gloo(hvd, args.port)
    got = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            got[kind].append(median_ms(*kind, args.numel, args.reps))
    if hvd.rank() == 0:
        print(f"allreduce of {args.numel:,} values on {hvd.size()} ranks, median ms of {args.reps}, by round:")
        for (library, dtype), ms in got.items():
            print(f"  {library:8s}{dtype:10s}" + " ".join(f"{x:7.2f}" for x in ms))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
