"""Communication cost of TernGrad's transports and of FP32/fp16 ring allreduce: the formulas behind
transport="auto" and the performance model's extrapolation to real clusters.

Per worker, for a gradient of n elements on N workers over links of bandwidth B (bytes/s) and latency a (s):

    FP32 ring allreduce     2 (N-1) a + 2 (N-1)/N * 4n / B
    fp16 ring allreduce     2 (N-1) a + 2 (N-1)/N * 2n / B
    TernGrad allgather      (N-1) a + (N-1) * (n/4 + 24) / B          each worker receives every other's codes
    TernGrad summed, fp16   2 (N-1) a + 2 (N-1)/N * 2n / B            code sums, exact for N <= 2048
    TernGrad summed, int8   2 (N-1) a + 2 (N-1)/N * n / B             through mpi4py, exact for N <= 127
    TernGrad sharded        2 (N-1) a + (N-1)/N * n/4 * (1 + b/2) / B codes to shard owners, b-bit sums back
    + scaler sharing        2 (N-1) a + 2 (N-1)/N * 16k / B for k tensors (one small Max allreduce)

(24: the record header, wire.HEADER_SIZE; 16: a tensor's scaler entry, wire.SCALER_ENTRY_BYTES.) Bandwidth
terms alone put the allgather/summed-fp16 crossover at N = 16, where (N-1) n/4 = 4n (N-1)/N, and the
allgather/summed-int8 crossover at N = 8; latency moves both slightly higher because the allgather needs
half the steps. Each transport of hvd_terngrad/transports.py states its own cost with these primitives, and
transports.choose_transport applies them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    bandwidth: float = 118e6  # bytes/s: 1 Gbit/s Ethernet after TCP
    latency: float = 50e-6  # s per message step


def allreduce_bytes(nbytes: float, n_workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring allreduce of `nbytes`."""
    return 2 * (n_workers - 1) / n_workers * nbytes


def allgather_bytes(nbytes_per_worker: float, n_workers: int) -> float:
    """Bytes each worker receives in an allgather of `nbytes_per_worker` from every worker."""
    return (n_workers - 1) * nbytes_per_worker


def allreduce_time(nbytes: float, n_workers: int, link: Link) -> float:
    if n_workers <= 1:
        return 0.0
    return 2 * (n_workers - 1) * link.latency + allreduce_bytes(nbytes, n_workers) / link.bandwidth


def allgather_time(nbytes_per_worker: float, n_workers: int, link: Link) -> float:
    if n_workers <= 1:
        return 0.0
    return (n_workers - 1) * link.latency + allgather_bytes(nbytes_per_worker, n_workers) / link.bandwidth


def alltoall_bytes(nbytes: float, n_workers: int) -> float:
    """Bytes each worker sends (and receives) in an alltoall of `nbytes` split evenly over the workers."""
    return (n_workers - 1) / n_workers * nbytes


def alltoall_time(nbytes: float, n_workers: int, link: Link) -> float:
    if n_workers <= 1:
        return 0.0
    return (n_workers - 1) * link.latency + alltoall_bytes(nbytes, n_workers) / link.bandwidth
