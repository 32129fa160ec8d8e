"""Which of many tensors hold NaN or Inf, at two small ops a tensor.

A check per tensor with isfinite is three ops (isfinite, all, a read back); on a latency-bound step of many
small tensors those cost more than the allreduce they guard (measured: docs/time-to-accuracy.md,
"Auto on the emulated cluster"). A sum in fp64 is two, and tells exactly: NaN and Inf make it non-finite,
and no sum of finite fp32, fp16 or bf16 values reaches fp64's range.
"""
from __future__ import annotations

import math

import torch


def nonfinite(tensors: list[torch.Tensor]) -> list[int]:
    """The indices of the tensors that hold NaN or Inf."""
    return [i for i, t in enumerate(tensors) if not math.isfinite(t.sum(dtype=torch.float64).item())]
