"""TernGradConfig: every knob of the algorithm in one validated place.

Policy lives here too: which tensors are coded, and the scaler rule. The paper (Wen et al., NeurIPS
2017, "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning") clips each
gradient to c * std (c = 2.5) and shares the max scaler across workers; without clipping the scaler is
max|g|. Clipping is the accuracy trade-off that matters most (57.6 vs 54.6 top-1 on AlexNet).
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from hvd_terngrad.codec import BACKENDS, Moments, check_block_size
from hvd_terngrad.commcost import Link
from hvd_terngrad.transports import TRANSPORTS as _TABLE
from hvd_terngrad.wire import payload_tag, tensor_id  # noqa: F401  (their home is the wire format)

TRANSPORTS = (*_TABLE, "auto")
ON_NONFINITE = ("raise", "skip", "propagate")


@dataclass(frozen=True)
class TernGradConfig:
    """Options of TernGrad, frozen: every rank's must be the same (the payload headers check).

    Attributes:
        clip: c of the scaler s = min(c * std(g), max|g|); 0 turns clipping off (s = max|g|).
        share_scaler: every rank codes with the max of the ranks' scalers (one tiny Max allreduce).
        min_numel: tensors with fewer elements pass through in float (plain allreduce average; where
            transport="auto" keeps fp16 for its uncoded groups, in fp16 with them: transports.uncoded).
        exclude: fnmatch patterns of parameter names that pass through in float, e.g. ("fc.*",); as min_numel's.
        seed: the Philox key; with step, rank and tensor it fixes every random draw.
        error_feedback: keep the coding error of each tensor and add it to the next step's gradient.
        owner_error_feedback: transport="sharded-ternary" only: each shard owner keeps the error of its second
            draw and adds it to its next average of that shard (dropped when the shard's layout changes, as with
            another world size). None (the default) follows error_feedback: with it on, every lossy draw is
            compensated; recommended() with sharded-ternary diverged on NCF without it (docs/transports.md).
        owner_clip: transport="sharded-ternary" only: c of each shard owner's scaler, min(c * std, max|a|) over
            its shard's averages a; 0 turns it off (max|a|: an unbiased second draw). Apart from clip because
            the owner's draw differs: one scaler for a whole shard of several tensors, and no error feedback by
            default. With clip=0 and error feedback on the workers, unclipped owners made LeNet-5 diverge at 4
            workers (docs/transports.md, sharded-ternary with recommended()).
        backend: codec backend, one of "auto", "cpu", "cuda", "reference".
        transport: how codes travel: "allgather" (2-bit codes, each worker receives all), "summed" (code sums in
            an fp16 allreduce, exact for N <= 2048), "summed-int8" (int8 sums through mpi4py, N <= 127,
            hvd_terngrad optimizer only), "sharded" (code sums through shard owners: an alltoall and an allgather,
            bit-identical to allgather), "sharded-ternary" (the owners ternarize their reply again; about 16x below
            an FP32 ring at any N), or "auto" (the cost model's choice per bucket from N and the link).
        on_nonfinite: "raise" an error on every rank, "skip" the step on every rank (skip needs
            hvd_terngrad.DistributedOptimizer, which owns the step), or "propagate": the tensor's average is NaN on
            every rank, as a float average would be, so that AMP's GradScaler sees the overflow, skips the step
            and lowers its scale (both optimizers).
        num_threads: CPU codec threads (default: torch.get_num_threads()).
        hierarchical: nodes with several ranks average inside the node in float and code only between nodes,
            one rank a node per bucket, then broadcast inside the node (hvd_terngrad.hierarchy; the
            hvd_terngrad optimizer on the global process set, which needs HOROVOD_DYNAMIC_PROCESS_SETS=1, or the
            DDP hook on the default process group).
        link_gbps: the link between workers in Gbit/s, for transport="auto"'s choice (default: the environment
            variable HVD_TERNGRAD_LINK_GBPS, else 1 Gbit/s Ethernet).
        timeout_s: the longest any of TernGrad's collectives may wait for its peers; past it the waiting rank
            raises CollectiveTimeoutError naming the tensor (summed-int8, whose MPI call cannot be cancelled,
            aborts the job instead). It must cover the slowest rank's lag in reaching a step, not only the transfer.
        block_size: one scaler per block of this many elements (a power of two >= 64) instead of one a tensor,
            clipped at the tensor's c * std (wire format version 2); None: one a tensor.

    Raises:
        ValueError: an option out of its range or not one of its names, naming the option and what it accepts.
    """

    clip: float = 2.5
    share_scaler: bool = True
    min_numel: int = 1024
    exclude: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0
    error_feedback: bool = False
    owner_error_feedback: bool | None = None
    owner_clip: float = 2.5
    backend: str = "auto"
    transport: str = "allgather"
    on_nonfinite: str = "raise"
    num_threads: int | None = None
    timeout_s: float = 300.0
    link_gbps: float | None = None
    hierarchical: bool = False
    block_size: int | None = None

    def __post_init__(self):
        if self.owner_error_feedback is None:
            object.__setattr__(self, "owner_error_feedback",
                               bool(self.error_feedback) and self.transport == "sharded-ternary")
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        else:
            object.__setattr__(self, "exclude", tuple(self.exclude))
        for name in ("clip", "owner_clip"):
            c = getattr(self, name)
            if not isinstance(c, (int, float)) or isinstance(c, bool) or not np.isfinite(c) or c < 0:
                raise ValueError(f"{name} must be a finite number >= 0 (0 turns clipping off), got {c!r}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {self.min_numel!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; allowed: {', '.join(BACKENDS)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; allowed: {', '.join(TRANSPORTS)}")
        if self.transport in _TABLE and _TABLE[self.transport].needs_shared_scaler and not self.share_scaler:
            raise ValueError(f"transport={self.transport!r} sums codes across ranks, which needs share_scaler=True")
        if self.owner_error_feedback and self.transport != "sharded-ternary":
            raise ValueError("owner_error_feedback keeps the shard owners' error of transport='sharded-ternary'; "
                             f"transport is {self.transport!r}")
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical must be True or False, got {self.hierarchical!r}")
        if self.hierarchical and self.transport == "summed-int8":
            raise ValueError("hierarchical=True codes over a process set of one rank a node, and "
                             "transport='summed-int8' works on the global process set only")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"unknown on_nonfinite {self.on_nonfinite!r}; allowed: {', '.join(ON_NONFINITE)}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be None or an integer >= 1, got {self.num_threads!r}")
        if not _positive(self.timeout_s):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if self.link_gbps is not None and not _positive(self.link_gbps):
            raise ValueError(f"link_gbps must be None or a finite number of Gbit/s > 0, got {self.link_gbps!r}")
        for pat in self.exclude:
            if not isinstance(pat, str):
                raise ValueError(f"exclude holds parameter-name patterns (str), got {pat!r}")

    @classmethod
    def recommended(cls, **overrides) -> TernGradConfig:
        """No clipping, error feedback and a scaler per 64 elements: the configuration that loses nowhere in the
        fidelity suite (its figures, and how to re-measure them: docs/results.md). The price: 14.2x
        compression instead of 16x (the 16-bit shared block scalers), and one copy of the coded gradients for
        the residuals.

        Args:
            **overrides: fields to set otherwise, e.g. transport="sharded-ternary".

        Returns:
            The TernGradConfig.
        """
        return cls(**{"clip": 0.0, "error_feedback": True, "block_size": 64, **overrides})

    def link(self) -> Link:
        """The link transport="auto" plans for: link_gbps, else HVD_TERNGRAD_LINK_GBPS, else commcost's default."""
        gbps = self.link_gbps
        if gbps is None and os.environ.get("HVD_TERNGRAD_LINK_GBPS"):
            try:
                gbps = float(os.environ["HVD_TERNGRAD_LINK_GBPS"])
            except ValueError:
                raise ValueError(f"HVD_TERNGRAD_LINK_GBPS must be a number of Gbit/s, got "
                                 f"{os.environ['HVD_TERNGRAD_LINK_GBPS']!r}") from None
            if not gbps > 0:
                raise ValueError(f"HVD_TERNGRAD_LINK_GBPS must be > 0, got {gbps}")
        return Link() if gbps is None else Link(bandwidth=gbps * 1e9 / 8)

    def compresses(self, name: str, numel: int) -> bool:
        """Whether a tensor is ternarized (True) or passes through in float (False)."""
        if numel < max(self.min_numel, 1):
            return False
        return not any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude)

    def scaler(self, st: Moments) -> float:
        """The local scaler, rounded to fp32 (the value that travels).

        With clipping, min(c * std, max|g|): the clipped elements get +-s, and where c * std exceeds
        max|g| the smaller max|g| codes the same tensor with less variance. A constant tensor (std 0)
        uses max|g|, which codes it exactly.
        """
        return _clipped(st, self.clip)

    def owner_scaler(self, st: Moments) -> float:
        """A sharded-ternary owner's scaler for its shard's averages: scaler()'s rule with c = owner_clip."""
        return _clipped(st, self.owner_clip)

    def block_scalers(self, st: Moments, absmax: torch.Tensor) -> torch.Tensor:
        """Per block, the scaler rule of scaler() with the block's max|g| (absmax: fp64 per block) and the
        tensor's std: fp32 min(c * std, max_b|g|). Clipping stays per tensor: per-block c * std_b clipped other
        elements than the paper does and, measured on the fidelity suite's gradients, added variance where it
        removed bias (docs/results.md, block scalers)."""
        s = absmax.double()
        if self.clip > 0 and st.std > 0:
            s = s.clamp(max=self.clip * st.std)
        return s.float()


def _clipped(st: Moments, c: float) -> float:
    """min(c * std, max|g|), or max|g| where c is 0 or std is 0, rounded to fp32."""
    s = st.absmax
    if c > 0 and st.std > 0:
        s = min(c * st.std, st.absmax)
    return float(np.float32(s))


def _positive(x) -> bool:
    """A finite number > 0 (bool is no number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and bool(np.isfinite(x)) and x > 0
