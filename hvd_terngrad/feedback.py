"""Error feedback: what a rank's coding lost, added to its next gradient of the same tensor.

TernGrad's codes are unbiased, but their variance grows with a tensor's scaler. Keeping the coding error
r = (g + r) - s*b and adding it to the next step's gradient (Seide et al., Interspeech 2014; Karimireddy et
al., ICML 2019) lets that error reach the model later instead of never. The price is one copy of every
coded gradient, updated in place by the codec's fused kernels (hvd_terngrad.codec). Two kinds are kept:
- worker residuals, one per coded tensor of this rank (error_feedback=True);
- owner residuals, one per bucket whose shard this rank owns under transport="sharded-ternary"
  (owner_error_feedback=True): the error of the owner's second draw.
A residual whose tensor changes size (another world size or bucket layout) is dropped, not misapplied.
"""
from __future__ import annotations

import torch


class ErrorFeedback:
    __slots__ = ("worker", "owner")

    def __init__(self):
        self.worker: dict[str, torch.Tensor] = {}  # tensor name -> residual, flat, in the gradient's dtype
        self.owner: dict[str, torch.Tensor] = {}  # bucket key -> residual of this rank's shard, fp32

    def residual(self, name: str, flat: torch.Tensor) -> torch.Tensor | None:
        """The residual to add to `flat` (coded as flat + residual by the fused kernels), or None."""
        kept = self.worker.get(name)
        return kept if kept is not None and kept.numel() == flat.numel() and kept.dtype == flat.dtype \
            and kept.device == flat.device else None

    def take(self, name: str, flat: torch.Tensor) -> torch.Tensor | None:
        """residual(), given up: for a gradient averaged uncoded, which carries the residual whole."""
        kept = self.residual(name, flat)
        if kept is not None:
            del self.worker[name]
        return kept

    def worker_out(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """Where the kernels write the residual of `flat`'s coding: the residual itself, updated in place, or a new
        buffer the first time (kept from then on: no allocation per step)."""
        kept = self.residual(name, flat)
        if kept is None:
            kept = self.worker[name] = torch.empty_like(flat, memory_format=torch.contiguous_format)
        return kept

    def owner_out(self, key: str, avg: torch.Tensor) -> torch.Tensor:
        """worker_out for an owner's shard."""
        kept = self.owner.get(key)
        if kept is None or kept.numel() != avg.numel():
            kept = self.owner[key] = torch.empty_like(avg)
        return kept

    def add_owner(self, key: str, avg: torch.Tensor) -> None:
        """An owner's average of its shard plus that shard's residual, in place (same layout only)."""
        kept = self.owner.get(key)
        if kept is not None and kept.numel() == avg.numel():
            avg += kept

    def state_dict(self) -> dict:
        """Copies of the residuals, for a checkpoint."""
        return {"worker": {k: v.detach().clone() for k, v in self.worker.items()},
                "owner": {k: v.detach().clone() for k, v in self.owner.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.worker = {k: v.clone() for k, v in state["worker"].items()}
        self.owner = {k: v.clone() for k, v in state["owner"].items()}
