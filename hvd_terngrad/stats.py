"""Per-step traffic and time accounting for TernGrad.

StepStats of the last finished step: bytes this rank contributed (sent) and received, the dense bytes
the same gradients take in their own dtype, the compression ratio, and the seconds spent coding
(stats + ternarize + pack), waiting on communication, and decoding: wall time, and the CPU time of the
thread that did it. Where cores are shared (several ranks a CPU, data loaders), the CPU time is what the
phase took from other work; the wall time also counts the waits for a core.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class StepStats:
    step: int = 0
    tensors_coded: int = 0
    tensors_float: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    time_encode: float = 0.0
    time_comm: float = 0.0
    time_decode: float = 0.0
    cpu_encode: float = 0.0
    cpu_comm: float = 0.0
    cpu_decode: float = 0.0
    skipped: bool = False

    @property
    def ratio(self) -> float:
        """Dense gradient bytes over bytes this rank put on the wire (higher is better)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


class StatsRecorder:
    """Collects the current step's numbers; `last` is the last finished step, `history` keeps a window."""

    def __init__(self, keep: int = 1000):
        self.current = StepStats()
        self.last: StepStats | None = None
        self.history: list[StepStats] = []
        self._keep = keep

    def finish_step(self, next_step: int) -> None:
        self.last = self.current
        self.history.append(self.current)
        if len(self.history) > self._keep:
            del self.history[: len(self.history) - self._keep]
        self.current = StepStats(step=next_step)

    def add_float(self, nbytes: int, nranks: int, tensors: int = 1) -> None:
        """`tensors` tensors of `nbytes` in all, averaged uncoded."""
        c = self.current
        c.tensors_float += tensors
        c.bytes_sent += nbytes
        c.bytes_received += nbytes * (nranks - 1)
        c.dense_bytes += nbytes

    def add_coded(self, payload_bytes: int, dense_bytes: int, nranks: int, scaler_bytes: int = 0,
                  received: int | None = None) -> None:
        """payload_bytes: what this rank puts on the wire; received: what it gets (default: every other
        rank's payload, as in an allgather)."""
        c = self.current
        c.tensors_coded += 1
        c.bytes_sent += payload_bytes + scaler_bytes
        c.bytes_received += (payload_bytes * (nranks - 1) if received is None else received) + \
            scaler_bytes * (nranks - 1)
        c.dense_bytes += dense_bytes

    @contextmanager
    def timed(self, phase: str):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            c = self.current
            setattr(c, f"time_{phase}", getattr(c, f"time_{phase}") + time.perf_counter() - t0)
            setattr(c, f"cpu_{phase}", getattr(c, f"cpu_{phase}") + time.thread_time() - c0)
