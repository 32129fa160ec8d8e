"""Every error class of hvd_terngrad, in one place. None of them needs Horovod or torch.distributed.

The TernGradError family is raised on every rank of a step alike (the ranks learn the same facts from the same
collectives), so that no rank is left waiting for a peer that already raised. CorruptPayload is the codec's
word for bytes no encoder writes; the pipeline turns it into a PayloadMismatchError that names the tensor.
"""
from __future__ import annotations


class TernGradError(RuntimeError):
    """Base class of the errors TernGrad raises on every rank."""


class NonFiniteGradientError(TernGradError):
    """A gradient held NaN or Inf on some rank; raised on every rank in the same step."""


class PayloadMismatchError(TernGradError):
    """Ranks sent records that do not belong together: another tensor, size, step or format."""


class CollectiveTimeoutError(TernGradError):
    """A collective of TernGrad's did not complete within timeout_s: a peer never joined it."""


class CorruptPayload(ValueError):
    """Codes that no encoder writes: 0b11, or a non-zero padding code."""
