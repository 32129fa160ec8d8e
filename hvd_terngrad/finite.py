"""Which of many tensors hold NaN or Inf, at two small ops a tensor.

A check per tensor with isfinite is three ops (isfinite, all, a read back); on a latency-bound step of many
small tensors those cost more than the allreduce they guard (measured: docs/notes/tta-log.md,
"Auto on the emulated cluster"). A sum is two. NaN and Inf survive any sum (Inf - Inf is NaN), so a finite
sum clears its tensor. A non-finite sum may also be finite values beyond fp32's range, so only then is the
tensor read element by element. The sum accumulates in fp32 (fp64 for fp64 tensors): in fp64 it is exact
without the second read, but it converts as it goes and takes about five times as long on a large tensor.
"""
from __future__ import annotations

import math

import torch

from hvd_terngrad.errors import NonFiniteGradientError


def nonfinite(tensors: list[torch.Tensor]) -> list[int]:
    """The indices of the tensors that hold NaN or Inf."""
    return [i for i, t in enumerate(tensors) if not _finite(t)]


def _finite(t: torch.Tensor) -> bool:
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item()
    return math.isfinite(total) or bool(torch.isfinite(t).all())


def absmax(x: torch.Tensor) -> float:
    """The largest |x| (NaN where x holds NaN), one pass: aminmax, which carries NaN."""
    if not x.numel():
        return 0.0
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi)) if not math.isnan(float(lo)) else math.nan


def nonfinite_average(name: str, culprit: int, step: int, rank: int, limit: float | None = None
                      ) -> NonFiniteGradientError:
    """The error for a float average (uncoded) that is not finite: every rank raises it in the same step.
    culprit: the rank whose gradient was non-finite, or -1 where none was (finite values whose sum is not).
    limit: where a gradient beyond ±limit counted as an overflow too (mark)."""
    what = "non-finite (NaN/Inf)" if limit is None else f"non-finite (NaN/Inf, or beyond ±{limit:.3g})"
    whose = f"gradient in {name!r} on rank {culprit}" if culprit >= 0 else f"average of {name!r}"
    return NonFiniteGradientError(f"hvd_terngrad: {what} {whose} at step {step}, averaged uncoded "
                                  f"(reported on rank {rank}; every rank sees the same average)")


def mark(tensors: list[torch.Tensor], rank: int, limit: float | None = None) -> list[int]:
    """Before a Sum allreduce, on a rank some of whose tensors hold NaN or Inf (or, given limit, a value beyond
    ±limit): each such tensor becomes zeros with +Inf at element `rank` (NaN throughout where it has no such
    element). Summed with finite tensors, and with the other such ranks' markers, its average is then +Inf at
    the element of each such rank and finite elsewhere, so every rank can tell whose gradient was non-finite
    with no second collective, by reading each tensor's first elements (marker_positions). Returns the indices
    of the tensors marked."""
    bad = nonfinite(tensors) if limit is None else [i for i, t in enumerate(tensors) if not absmax(t) <= limit]
    for i in bad:
        flat = tensors[i].view(-1)
        if flat.numel() > rank:
            flat.zero_()
            flat[rank] = math.inf
        else:
            flat.fill_(math.nan)
    return bad


def marked_rank(average: torch.Tensor, size: int) -> int:
    """The lowest rank whose marker (mark) a non-finite average carries; -1 where it carries none (finite
    values whose sum is not, or a tensor too small to carry one)."""
    hits = torch.isposinf(average.reshape(-1)[:size]).nonzero()
    return int(hits[0]) if hits.numel() else -1


def marker_positions(offsets: list[tuple[int, int]], size: int) -> torch.Tensor | None:
    """The elements of a flat buffer where mark() of any of `size` ranks can leave its marker: the first `size`
    elements of each tensor, given as (offset, elements). None where they are most of the buffer (read it all).
    Where every rank sends values no Sum can take beyond fp32's range, the average is finite exactly where
    these elements are, so a check of the average reads them alone, not the whole buffer."""
    picked = [torch.arange(off, off + min(n, size)) for off, n in offsets if n]
    total = sum(min(n, size) for _, n in offsets)
    if not picked or 2 * total >= sum(n for _, n in offsets):
        return None
    return torch.cat(picked)
