"""What every codec backend implements (Backend), and the values that cross it: a gradient's Moments and the
RngKey of its Philox stream. hvd_terngrad.codec binds a backend (Codec) and re-exports these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class Moments(NamedTuple):
    mean: float
    std: float
    absmax: float
    nonfinite: int


@dataclass(frozen=True)
class RngKey:
    """What the Philox stream of one tensor on one rank in one step is keyed by."""

    seed: int
    step: int
    rank: int
    tensor_id: int

    def __post_init__(self):
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not 0 <= self.rank < 2**16:
            raise ValueError(f"rank must be in [0, 65536), got {self.rank}")
        if not 0 <= self.tensor_id < 2**32:
            raise ValueError(f"tensor_id must be in [0, 2**32), got {self.tensor_id}")


class Backend(Protocol):
    """What a codec backend implements, on flat contiguous tensors that Codec has checked. Decodes return
    False where a code is invalid (0b11, or a non-zero padding code)."""

    name: str

    # r: a residual to add to x (error feedback) or None; r_out: where the new residual goes (may be r) or None.
    def moments(self, x, r=None) -> tuple[float, float, float, int]: ...
    def moments_blocks(self, x, block: int, r=None) -> tuple[tuple[float, float, float, int], torch.Tensor]: ...
    def block_absmax(self, x, block: int) -> torch.Tensor: ...  # fp64, one per block, on x's device
    def ternarize_pack(self, x, scaler: float, key: RngKey, out, r=None, r_out=None) -> None: ...
    def ternarize_pack_blocks(self, x, scalers, block: int, key: RngKey, out, r=None, r_out=None) -> None: ...
    def decode_mean(self, codes, scalers: list[float], shared: bool, n: int, out) -> bool: ...
    def decode_mean_blocks(self, codes, scalers, shared: bool, n: int, block: int, out) -> bool: ...
    def sum_shards(self, shards, nranks: int, out) -> bool: ...
    def decode_packed_sums(self, packed, nranks: int, start: int, n: int, scaler: float, out) -> None: ...
    # x and h contiguous, out of their size (from_half's: of any layout), any shape (not made flat: per tensor, a
    # view costs more than a small kernel)
    def to_half(self, x, scale: float, out) -> None: ...  # out: fp16
    def from_half(self, h, scale: float, out, only_finite: bool) -> float: ...  # out: any float dtype, or None
    # a group back to back in one fp16 tensor, in one call where the backend can (Codec.to_halves)
    def to_halves(self, xs, scales: list[float], out) -> None: ...
    def from_halves(self, h, sizes: list[int], scales: list[float], outs, only_finite: bool) -> list[float]: ...
    def scale(self, x, factor: float) -> float: ...  # x: contiguous fp32, in place
