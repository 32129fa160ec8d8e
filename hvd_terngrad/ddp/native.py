"""The DDP hook's C++ path (csrc/ddp_hook.cpp): when it takes a step's buckets, and what it asks of Python."""
import warnings
import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from hvd_terngrad.ddp.averages import (
    bucket_marker_positions,
    failed_average,
    forget_later_buckets,
    nonfinite_averaged,
    sendable,
)
from hvd_terngrad.finite import mark
from hvd_terngrad.transports.uncoded import UNCODED

if TYPE_CHECKING:
    from hvd_terngrad.ddp.state import TernGradState

# The wires of the plans the C++ path averages (Native.steer), offered to transport="auto" as its faster path
# (AutoPlan.offer): fp32 first, the plan in force where auto's plan is untried. bf16 halves the bytes for two passes
# (the rounding, and the reading back), which the trial weighs; fp16 needs a scale per tensor and, where one
# outgrows it, a second average, which the C++ path does not make.
NATIVE_WIRES = ("fp32", "bf16")


class Native:
    """The hook's C++ path (csrc/ddp_hook.cpp, TernGradState.register): when it takes the buckets (steer),
    and what it asks of Python: a bucket's layout once, a rank's markers and a non-finite average's error where a
    value is out of range, and the step's end once a step. It averages as OwnAverages.start does, whose
    docstring says why each piece is there. It holds its state weakly, as start()'s callbacks do."""

    __slots__ = ("owner", "control", "at_end", "wire", "merging", "named", "mine", "held", "__weakref__")

    def __init__(self, owner: "TernGradState"):
        self.owner = weakref.ref(owner)
        self.control = None  # hvd_terngrad._ddp_hook.Control: on, or off (every bucket to terngrad_hook)
        self.at_end = False  # whether it ends each step once completed (auto's trial), as last enabled
        self.wire = "fp32"  # what the averages travel in (NATIVE_WIRES), as last enabled
        self.merging = False  # whether each bucket first takes its residuals (merge), as last enabled
        self.named: dict = {}  # bucket index -> (its gradients as TernGradState.gradients, its bytes)
        self.mine: dict = {}  # bucket index -> the tensors this rank marked there this step (finite.mark)
        self.held: list = []  # this step's non-finite averages, (bucket index, error), raised by the last bucket

    def steer(self) -> None:
        """At a step's end (TernGradState.end_step): whether the C++ path averages the next step. It does where
        transport="auto"'s plan for it sends every bucket in a wire of NATIVE_WIRES, in its trial (whose steps it
        then ends once they have completed, as the other kinds' steps end, so that the trial times each kind
        alike) or decided, where every bucket is a contiguous fp32 buffer on the CPU, whose codec has tg_scale; with
        error feedback, the step after a coded one first merges each bucket's residuals (merge). Otherwise
        terngrad_hook averages the next step. Where this path can run them, auto's trial tries the plan in these
        wires alone and keeps another kind only where it is clearly faster (AutoPlan.prefer): on a fast link, the
        fp16 plan in Python costs a step what any Python hook does, and the trial's six steps cannot resolve
        that."""
        if self.control.on and not self.at_end and not self.merging:
            return  # the plan kept, no residual left to merge: nothing here changes (load_state_dict turns it off)
        owner = self.owner()
        pipe = owner.pipeline
        wire, trying = owner.uncoded_wire(), pipe.plan.deciding
        native = wire in NATIVE_WIRES
        backend = self._backend(owner) if native or trying else None
        if trying:  # where this path runs the plan, its wires are auto's default
            pipe.auto.offer(NATIVE_WIRES if backend is not None else ())
        if backend is None or not native:
            self.control.disable()
            return
        at_end, merging = pipe.plan.deciding, bool(pipe.coder.feedback.worker)
        if not self.control.on or (self.at_end, self.wire, self.merging) != (at_end, wire, merging):
            size = owner.world.size
            self.control.enable(owner.world.group, size, backend.scale_kernel(), sendable(size), pipe.step, at_end,
                                wire == "bf16", merging)
            self.at_end, self.wire, self.merging = at_end, wire, merging

    @staticmethod
    def _backend(owner: "TernGradState"):
        """The buckets' codec backend where this path can average them (the hook's own group, no hierarchy, every
        bucket a contiguous fp32 buffer on the CPU, a codec with tg_scale), else None."""
        if owner.process_group is not None or owner.hierarchy is not None or not owner.plain:
            return None
        backend = owner.pipeline.coder.codec.impl(torch.empty(0))  # the buckets' (on the CPU)
        return backend if hasattr(backend, "scale_kernel") else None

    def layout(self, bucket: dist.GradBucket) -> tuple:
        """A bucket's new layout: (the positions where its average can carry a marker, or None to read it all;
        tg_scale's threads for its buffer)."""
        owner = self.owner()
        buf = bucket.buffer()
        where = bucket_marker_positions(bucket, buf, owner.world.size)
        self.named[bucket.index()] = (owner.gradients(bucket), buf.numel() * buf.element_size())
        forget_later_buckets(self.named, bucket)
        return None if where is None else where.tolist(), owner.pipeline.coder.codec.impl(buf).threads_for(buf.numel())

    def merge(self, index: int) -> None:
        """Before the scaling, on the step after a coded one (steer): a coded step's error-feedback residuals added
        into bucket `index`'s gradients, and let go, as OwnAverages.start adds them (Coder.merge_residual)."""
        coder = self.owner().pipeline.coder
        for name, grad in self.named[index][0]:
            coder.merge_residual(name, grad)

    def mark(self, index: int) -> None:
        """Before the send: this rank's tensors of bucket `index` beyond sendable, or not finite, marked."""
        owner = self.owner()
        grads = [grad for _, grad in self.named[index][0]]
        self.mine[index] = mark(grads, owner.world.rank, sendable(owner.world.size))

    def nonfinite(self, index: int, step: int) -> Optional[str]:
        """Bucket `index`'s average is not finite: "held" where its error waits for the step's last bucket."""
        owner = self.owner()
        limit = None if owner.config.on_nonfinite == "propagate" else sendable(owner.world.size)
        error = nonfinite_averaged(self.named[index][0], self.mine.pop(index, []), owner.world.rank,
                                    owner.world.size, step, limit)
        if error is None:
            return None
        self.held.append((index, error))
        return "held"

    def failed(self, index: int, what: str, step: int) -> str:
        """The message DDP raises where bucket `index`'s allreduce failed (this rank's markers there, if any,
        go with the step: a later step's non-finite average must not name them)."""
        self.mine.pop(index, None)
        return _message(failed_average(index, self.named[index][0], self.owner().world.rank, step, what))

    def step_done(self, buckets: list) -> int:
        """The step's end, its last allreduce launched: its byte counts, and the pipeline's next step."""
        owner = self.owner()
        pipe, size = owner.pipeline, owner.world.size
        sent = UNCODED[self.wire].element_bytes  # a value's bytes on the wire, of the buffer's 4
        for index in buckets:
            named, nbytes = self.named[index]
            pipe.stats.add_float(nbytes * sent // 4, size, tensors=len(named))
        owner.end_step()
        return pipe.step

    def raise_held(self) -> Optional[str]:
        """The message DDP raises for the step's first non-finite average, as OwnAverages.after raises it."""
        held, self.held = self.held, []
        return _message(min(held, key=lambda h: h[0])[1]) if held else None


def _message(error: BaseException) -> str:
    """An error as DDP raises one from a hook's callback: its type's name and its message."""
    return f"{type(error).__name__}: {error}"


def native_module():
    """hvd_terngrad._ddp_hook, or None (a warning, once) where it is not built or not built for this torch."""
    global _NATIVE
    if _NATIVE is None:
        try:
            from hvd_terngrad import _ddp_hook
            _NATIVE = _ddp_hook
        except ImportError as exc:
            _NATIVE = False
            warnings.warn(f"hvd_terngrad: the DDP hook's C++ path is not available ({exc}); the hook runs in Python, "
                          "which costs a step on a fast link 5-6% (rebuild against this torch: scripts/install.sh, "
                          "or pip install --no-build-isolation .)", stacklevel=3)
    return _NATIVE or None


_NATIVE = None  # hvd_terngrad._ddp_hook once loaded; False where it cannot be
