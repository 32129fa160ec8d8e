"""Which of many tensors hold NaN or Inf, at two small ops a tensor.

A check per tensor with isfinite is three ops (isfinite, all, a read back); on a latency-bound step of many
small tensors those cost more than the allreduce they guard (measured: docs/time-to-accuracy.md,
"Auto on the emulated cluster"). A sum is two. NaN and Inf survive any sum (Inf - Inf is NaN), so a finite
sum clears its tensor. A non-finite sum may also be finite values beyond fp32's range, so only then is the
tensor read element by element. The sum accumulates in fp32 (fp64 for fp64 tensors): in fp64 it is exact
without the second read, but it converts as it goes and takes about five times as long on a large tensor.
"""
from __future__ import annotations

import math

import torch


def nonfinite(tensors: list[torch.Tensor]) -> list[int]:
    """The indices of the tensors that hold NaN or Inf."""
    return [i for i, t in enumerate(tensors) if not _finite(t)]


def _finite(t: torch.Tensor) -> bool:
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item()
    return math.isfinite(total) or bool(torch.isfinite(t).all())
