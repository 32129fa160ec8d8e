"""Communication cost of TernGrad's transports and of FP32/fp16 ring allreduce: the formulas behind
transport="auto" and the performance model's extrapolation to real clusters.

Per worker, for a gradient of n elements on N workers over links of bandwidth B (bytes/s) and latency a (s):

    FP32 ring allreduce     2 (N-1) a + 2 (N-1)/N * 4n / B
    fp16 ring allreduce     2 (N-1) a + 2 (N-1)/N * 2n / B
    TernGrad allgather      (N-1) a + (N-1) * (n/4 + 24) / B          each worker receives every other's codes
    TernGrad summed, fp16   2 (N-1) a + 2 (N-1)/N * 2n / B            code sums, exact for N <= 2048
    TernGrad summed, int8   2 (N-1) a + 2 (N-1)/N * n / B             through mpi4py, exact for N <= 127
    + scaler sharing        2 (N-1) a + 2 (N-1)/N * 16k / B for k tensors (one small Max allreduce)

(24: the record header, wire.HEADER_SIZE; 16: a tensor's scaler entry, wire.SCALER_ENTRY_BYTES.) Bandwidth
terms alone put the allgather/summed-fp16 crossover at N = 16, where (N-1) n/4 = 4n (N-1)/N, and the
allgather/summed-int8 crossover at N = 8; latency moves both slightly higher because the allgather needs
half the steps. `choose_transport` applies this model.
"""
from __future__ import annotations

from dataclasses import dataclass

from hvd_terngrad.wire import HEADER_SIZE

TRANSPORTS = ("allgather", "summed", "summed-int8", "fp32", "fp16")


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


def transport_time(transport: str, numel: int, n_workers: int, link: Link) -> float:
    """Seconds to exchange one coded tensor of `numel` elements (scaler sharing not included)."""
    if transport == "allgather":
        return allgather_time(numel / 4 + HEADER_SIZE, n_workers, link)
    if transport == "summed":
        return allreduce_time(2 * numel, n_workers, link)
    if transport == "summed-int8":
        return allreduce_time(numel, n_workers, link)
    if transport == "fp32":
        return allreduce_time(4 * numel, n_workers, link)
    if transport == "fp16":
        return allreduce_time(2 * numel, n_workers, link)
    raise ValueError(f"unknown transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")


def choose_transport(numel: int, n_workers: int, link: Link | None = None, int8: bool = False) -> str:
    """The cheaper TernGrad transport for a bucket of `numel` coded elements under this model."""
    link = link or Link()
    cands = ["allgather", "summed"] + (["summed-int8"] if int8 and n_workers <= 127 else [])
    if n_workers > 2048:
        cands.remove("summed")
    return min(cands, key=lambda t: transport_time(t, numel, n_workers, link))


def resolve_transport(configured: str, numel: int, n_workers: int, int8: bool) -> str:
    """The transport a group of `numel` coded elements takes: the configured one, or for "auto" the model's
    choice (int8: whether the caller can run summed-int8)."""
    if configured != "auto":
        return configured
    return choose_transport(numel, n_workers, int8=int8)


def crossover_nodes(numel: int, link: Link | None = None, summed: str = "summed", max_nodes: int = 4096) -> int:
    """The smallest N at which `summed` beats the allgather for a tensor of `numel` elements."""
    link = link or Link()
    for n in range(2, max_nodes + 1):
        if transport_time(summed, numel, n, link) < transport_time("allgather", numel, n, link):
            return n
    return max_nodes + 1
