"""One rank's coding of its tensors: what a transport encodes with, and what survives from step to step.

A Coder knows the options, this rank and the world size, the step, the error feedback and the stats; it never
communicates. Its items are the tensors of one group on this rank. The pipeline (hvd_terngrad.pipeline) moves
them through the collectives; each transport (hvd_terngrad.transports) lays their codes out on the wire.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import hvd_terngrad.codec as codec
from hvd_terngrad.config import TernGradConfig, payload_tag, tensor_id
from hvd_terngrad.errors import NonFiniteGradientError
from hvd_terngrad.feedback import ErrorFeedback
from hvd_terngrad.finite import absmax
from hvd_terngrad.stats import StatsRecorder
from hvd_terngrad.wire import BLOCK_SCALER_BYTES, BLOCK_SCALER_LIMIT, SCALER_ENTRY_BYTES, round_block_scalers


@dataclass
class Item:
    """One tensor of one step on this rank."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    flat: torch.Tensor  # contiguous, 1-D, the gradient
    residual: torch.Tensor | None  # error feedback: what is coded is flat + residual (summed by the kernels)
    tag: int
    tid: int
    scaler: float  # local scaler, then the shared one once shared
    nonfinite_rank: int  # -1 if every rank's tensor is finite (as far as known)
    offset: int = 0  # where the transport put it: its own unit (bytes of a record, a stream, or elements)
    scalers: torch.Tensor | None = None  # block_size: fp32 (CPU) per block, local then shared; `scaler` is their max

    @property
    def numel(self) -> int:
        return self.flat.numel()


class Coder:
    def __init__(self, config: TernGradConfig, rank: int, size: int, stats: StatsRecorder | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside world of size {size}")
        self.config = config
        self.rank = rank
        self.size = size
        self.step = 0
        self.codec = codec.Codec(config.backend, config.num_threads)
        self.feedback = ErrorFeedback()
        self.stats = stats if stats is not None else StatsRecorder()
        self.scalers_used: dict[str, float] = {}  # name -> scaler of its last coding (shared when sharing)
        # name -> the largest |average| of its last uncoded average that measured it (transports.uncoded)
        self.magnitudes: dict[str, float] = {}
        self._scratch: dict[str, torch.Tensor] = {}

    def next_step(self) -> None:
        self.step += 1
        self.stats.finish_step(self.step)

    def magnitude(self, name: str) -> float | None:
        """The size of a tensor's values that every rank knows alike (a 16-bit average scales by it:
        transports.uncoded.half_scale): the largest |average| of its last measured uncoded average, else its
        shared scaler where it was coded; None where neither is known."""
        m = self.magnitudes.get(name)
        if m is None and self.config.share_scaler:
            m = self.scalers_used.get(name)
        return m

    def measure(self, name: str, average: torch.Tensor) -> bool:
        """Whether an uncoded fp32 average is finite; if it is, its largest |value| becomes the tensor's magnitude
        (note_magnitude). (An fp16 group's averages are measured as they are read back: Codec.from_halves.)"""
        return self.note_magnitude(name, absmax(average))

    def note_magnitude(self, name: str, m: float) -> bool:
        """Whether m, the largest |average| of an uncoded average, is finite; if it is, it becomes the tensor's
        magnitude (zero too: such a tensor travels in fp32 next time, and is measured)."""
        if not math.isfinite(m):
            return False
        self.magnitudes[name] = m
        return True

    def key(self, item: Item) -> codec.RngKey:
        return codec.RngKey(self.config.seed, self.step & 0xFFFFFFFF, self.rank, item.tid)

    def check_dtype(self, name: str, grad: torch.Tensor) -> None:
        if grad.dtype not in codec.SUPPORTED_DTYPES:
            raise TypeError(f"hvd_terngrad: gradient of {name!r} on rank {self.rank} has dtype {grad.dtype}; "
                            f"TernGrad codes fp32, fp64, fp16 and bf16 gradients")
        if grad.is_sparse:
            raise TypeError(f"hvd_terngrad: gradient of {name!r} on rank {self.rank} is sparse; "
                            f"TernGrad codes dense gradients (use sparse_as_dense=True or exclude it)")

    def prepare(self, name: str, grad: torch.Tensor) -> Item:
        """The item of `grad`: its residual added, its moments and local scaler (or block scalers)."""
        cfg = self.config
        with self.stats.timed("encode"):
            flat, residual = self._flat(name, grad)
            scalers = None
            if cfg.block_size:
                st, absmax = self.codec.moments_blocks(flat, cfg.block_size, residual=residual)
                # shared block scalers travel at 16 bits (wire.round_block_scalers), below 2^121
                bad = st.nonfinite > 0 or (cfg.share_scaler and st.absmax >= BLOCK_SCALER_LIMIT)
                scalers = torch.zeros(absmax.numel()) if bad else cfg.block_scalers(st, absmax.cpu())
                if cfg.share_scaler:
                    scalers = round_block_scalers(scalers)
            else:
                st = self.codec.moments(flat, residual=residual)
                bad = st.nonfinite > 0
        if bad:
            scaler = 0.0
        elif scalers is None:
            scaler = cfg.scaler(st)
        else:  # the tensor's entry in the scaler vector: its largest block scaler
            scaler = float(scalers.max()) if scalers.numel() else 0.0
        return Item(name=name, shape=grad.shape, dtype=grad.dtype, flat=flat, residual=residual,
                    tag=payload_tag(name, grad.shape, grad.dtype), tid=tensor_id(name),
                    scaler=scaler, nonfinite_rank=self.rank if bad else -1, scalers=scalers)

    def plain(self, name: str, grad: torch.Tensor) -> Item:
        """The item of `grad` for a group sent uncoded (hvd_terngrad.auto): no moments, no scaler, its residual
        merged into it."""
        flat, _ = self._flat(name, grad)
        self.merge_residual(name, flat)
        return Item(name=name, shape=grad.shape, dtype=grad.dtype, flat=flat, residual=None,
                    tag=payload_tag(name, grad.shape, grad.dtype), tid=tensor_id(name), scaler=0.0, nonfinite_rank=-1)

    def merge_residual(self, name: str, grad: torch.Tensor) -> None:
        """Error feedback, for a gradient about to be averaged uncoded: its residual added into it (the average
        carries it, so nothing is lost), and let go. Kept at zero, it would cost two passes over the tensor at
        every uncoded step; coded again, the tensor starts a new one."""
        if self.config.error_feedback:
            residual = self.feedback.take(name, grad)  # it checks size, dtype and device only
            if residual is not None:
                grad.add_(residual.view(grad.shape))

    def _flat(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`grad` checked, as one contiguous flat tensor, and its error-feedback residual (or None)."""
        self.check_dtype(name, grad)
        flat = grad.detach().reshape(-1)
        flat = flat if flat.is_contiguous() else flat.contiguous()
        return flat, self.feedback.residual(name, flat) if self.config.error_feedback else None

    def codes(self, it: Item, out: torch.Tensor | None = None) -> torch.Tensor:
        """it's packed codes (into out), with its scaler or block scalers. With error feedback the kernels code
        flat + residual and write what the coding lost back into the residual, in place."""
        ef = {}
        if self.config.error_feedback:
            ef = {"residual": it.residual, "residual_out": self.feedback.worker_out(it.name, it.flat)}
        if it.scalers is not None:
            return self.codec.ternarize_pack_blocks(it.flat, it.scalers, self.config.block_size, self.key(it),
                                                    out=out, **ef)
        return self.codec.ternarize_pack(it.flat, it.scaler, self.key(it), out=out, **ef)

    def code_into(self, it: Item, codes: torch.Tensor) -> None:
        """Write it's packed codes into `codes` (all zero for a non-finite tensor, whose residual stays)."""
        self.scalers_used[it.name] = it.scaler
        if it.nonfinite_rank >= 0:
            codes.zero_()
            return
        self.codes(it, out=codes)

    def code_values(self, it: Item) -> torch.Tensor | None:
        """it's codes as fp32 values in {-1, 0, 1} (a scratch buffer), None for a non-finite tensor."""
        self.scalers_used[it.name] = it.scaler
        if it.nonfinite_rank >= 0:
            return None
        return self.codec.decode_mean([self.codes(it)], [1.0], True, it.numel,
                                      out=self.scratch(it.numel, it.flat.device))

    def scratch(self, n: int, device: torch.device, use: str = "values") -> torch.Tensor:
        """A reused fp32 buffer per use: the values encoder's ±1 codes, or a shard owner's averages, would
        otherwise be a fresh (page-faulting) allocation per tensor and step."""
        buf = self._scratch.get(use)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = self._scratch[use] = torch.empty(n, dtype=torch.float32, device=device)
        return buf[:n]

    def scaler_bytes(self, it: Item) -> int:
        """What a coded tensor adds to the scaler Max allreduces (share_scaler)."""
        return SCALER_ENTRY_BYTES + (BLOCK_SCALER_BYTES * it.scalers.numel() if it.scalers is not None else 0)

    @staticmethod
    def nonfinite(items: list[Item]) -> list[Item]:
        return [it for it in items if it.nonfinite_rank >= 0]

    def raise_nonfinite(self, items: list[Item]) -> None:
        bad = self.nonfinite(items)
        if bad:
            it = bad[0]
            names = ", ".join(repr(b.name) for b in bad[:5])
            beyond = " or, with shared block scalers, of magnitude 2^121 or more" if self.config.block_size \
                and self.config.share_scaler else ""
            raise NonFiniteGradientError(
                f"hvd_terngrad: non-finite (NaN/Inf{beyond}) gradient in {it.name!r} on rank {it.nonfinite_rank} "
                f"at step {self.step} (reported on rank {self.rank}; affected: {names}). Every rank raises this in the "
                f"same step; on_nonfinite='skip' (hvd_terngrad.DistributedOptimizer) skips such steps, and "
                f"on_nonfinite='propagate' hands AMP's GradScaler a NaN average instead.")
