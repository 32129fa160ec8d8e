"""The fp32 averages the DDP hook makes itself, in place, as DDP's own allreduce makes them (OwnAverages), and
the non-finite protocol they share with the hook's C++ path (native.Native): a rank marks what it cannot send,
and the average names tensor and rank on every rank with no collective in a callback (hvd_terngrad.finite)."""
import math
import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from hvd_terngrad.errors import CollectiveTimeoutError, NonFiniteGradientError, TernGradError
from hvd_terngrad.finite import mark, marked_rank, marker_positions, nonfinite, nonfinite_average

if TYPE_CHECKING:
    from hvd_terngrad.ddp.state import TernGradState


class OwnAverages:
    """The buckets a TernGradState averages itself in a step (hook.route: Path.OWN), and what the step's
    last bucket waits for."""

    __slots__ = ("sums", "nonfinite", "markers")

    def __init__(self):
        self.sums: list = []  # this step's averages started here (their checks' futures), until its last bucket
        self.nonfinite: list = []  # this step's non-finite averages there, (bucket index, error), for the last
        self.markers: dict = {}  # bucket index -> its Markers

    def start(self, owner: "TernGradState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's fp32 average as DDP's own allreduce makes it: in place, started here, no worker thread,
        divided by the world size before the sum (_divide). A rank whose bucket is not finite, or holds a value
        beyond sendable(size), first marks those tensors (finite.mark), so that a non-finite average names
        tensor and rank on every rank with no collective in a callback. As no rank sends more than that, N sums
        stay within fp32's range, and the check of the average reads only the elements a marker can be at
        (Markers), not the whole buffer gloo has just written. The allreduce runs on the hook's own group,
        whose gloo timeout is timeout_s: a rank that never joins fails it in bounded time, as the worker's
        bounded waits do.

        A non-finite average leaves through the step's last bucket, whose future completes once every earlier
        average of the step and its check have (after; the worker's _held_back, for the same reason):
        raised from an earlier bucket, it let DDP end the step while this rank's later allreduces, or a late
        peer's, were in flight, and a training loop that then tore its process group down aborted a process
        ("Resource deadlock avoided": the group destroyed on its own gloo thread). A failed allreduce is raised
        at once."""
        pipe, me, size, buf = owner.pipeline, owner.world.rank, owner.world.size, bucket.buffer()
        # the gradients as (name, view of buf), made only where this step needs them (a view each): residuals kept
        # from the coded steps, merged once, or a bucket that is not finite
        named = owner.gradients(bucket) if pipe.coder.feedback.worker else None
        for name, grad in named or ():
            pipe.coder.merge_residual(name, grad)
        params = bucket.parameters()
        markers, mine, limit = self._markers(bucket, buf, params, size, pipe.coder.codec), [], sendable(size)
        if not _divide(buf, size, markers.scale) <= limit:  # NaN included
            named = named or owner.gradients(bucket)
            mine = mark([grad for _, grad in named], me, limit)
        pipe.stats.add_float(buf.numel() * 4, size, tensors=len(params))
        summed = dist.all_reduce(buf, group=owner.world.group, async_op=True).get_future()
        step, last, index, held = pipe.step, bucket.is_last(), bucket.index(), self.nonfinite
        # The callbacks below hold the owner weakly: gloo's thread lets go of a callback after it ran, maybe after
        # the training has gone on and torn its process groups down, and the last reference to the owner's group
        # must not go there (a process group destroyed on its own thread aborts the process: "Resource deadlock
        # avoided"). DDP holds the state while its buckets are in flight.
        state, propagate = weakref.ref(owner), owner.config.on_nonfinite == "propagate"

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            nonlocal named
            try:
                fut.value()
            except RuntimeError as exc:
                named = named or state().gradients(bucket)
                raise failed_average(index, named, me, step, exc) from None
            if not _finite_average(markers, buf):
                named = named or state().gradients(bucket)
                error = nonfinite_averaged(named, mine, me, size, step, None if propagate else limit)
                if error is not None:
                    held.append((index, error))
            return buf

        if not last:  # the step's last bucket waits for this callback, not for the allreduce alone (after)
            done = summed.then(finish)
            self.sums.append(done)
            return done

        def finish_last(fut: torch.futures.Future) -> torch.Tensor:
            try:
                return finish(fut)
            finally:
                state().end_step()

        return self.after(summed, finish_last)

    def _markers(self, bucket: dist.GradBucket, buf: torch.Tensor, params: list, size: int, codec) -> "Markers":
        """Where the bucket's average can carry a marker of any of `size` ranks, kept while its buffer and layout
        last (DDP may plan its buckets again, so they are checked, not assumed); buf, params: its buffer and
        parameters."""
        key = (size, buf.data_ptr(), tuple(map(id, params)))
        known = self.markers.get(bucket.index())
        if known is None or known.key != key:
            known = self.markers[bucket.index()] = Markers(key, bucket, buf, size, codec)
            forget_later_buckets(self.markers, bucket)
        return known

    def after(self, last: torch.futures.Future, finish) -> torch.futures.Future[torch.Tensor]:
        """The future of the step's last bucket (`last`, its value finish(last)), completed once every average
        start() began this step has, and raising the first bucket's non-finite average held there.

        It collects each earlier average's callback (its finish), not its allreduce: a callback that a future
        runs on completion may still be running, or waiting for the GIL, on gloo's thread when a later hook adds
        another callback to the same future, which then runs at once. Collecting the allreduces, the step's last
        bucket ended before the earlier finish had held its error, and a NaN step went on unraised."""
        sums, held, self.sums, self.nonfinite = self.sums, self.nonfinite, [], []

        def finish_step(_) -> torch.Tensor:
            value = finish(last)  # every earlier bucket's finish has run: collect_all waited for them
            if held:  # the last bucket's own, if it was averaged here, among them
                raise min(held, key=lambda h: h[0])[1]  # the first bucket's, as DDP would have met it
            return value

        return (torch.futures.collect_all(sums + [last]) if sums else last).then(finish_step)


class Markers:
    """Where a bucket's average can carry a marker (finite.marker_positions), and how to read them."""

    __slots__ = ("key", "where", "at", "values", "scale")

    def __init__(self, key: tuple, bucket: dist.GradBucket, buf: torch.Tensor, size: int, codec):
        self.key = key  # (world size, the buffer's address, its parameters' ids): this holds the buffer (values)
        self.where = bucket_marker_positions(bucket, buf, size)  # None: most of the buffer, read it all
        cpu = self.where is not None and buf.device.type == "cpu"
        self.at = self.where.tolist() if cpu else None  # the same, as Python ints
        # the buffer's elements as Python floats: on the CPU the check reads them with no torch op on gloo's
        # thread, where one op's dispatch alone cost about 40 µs (measured: docs/notes/tta-log.md, "The DDP
        # hook's own fp32 averages")
        self.values = memoryview(buf.numpy()) if cpu else None
        self.scale = codec.impl(buf).scale  # the codec's backend for the buffer (Backend.scale)


def forget_later_buckets(known: dict, bucket: dist.GradBucket) -> None:
    """A new layout of the step's last bucket: DDP has fewer buckets than before, and what `known` (bucket index
    -> what was worked out for it) keeps of the later ones no longer holds their old buffers."""
    if bucket.is_last():
        for index in [i for i in known if i > bucket.index()]:
            del known[index]


def bucket_marker_positions(bucket: dist.GradBucket, buf: torch.Tensor, size: int) -> Optional[torch.Tensor]:
    """finite.marker_positions of a bucket's buffer `buf`, for `size` ranks."""
    return marker_positions([(g.storage_offset() - buf.storage_offset(), g.numel()) for g in gradient_views(bucket)],
                            size)


def gradient_views(bucket: dist.GradBucket) -> list:
    """The bucket's gradients as views of its buffer that cover it, one per parameter. A complex parameter's
    gradient lies in the buffer as its real view (torch.view_as_real: 2 reals per element, the parameters one
    after another), where DDP's bucket.gradients() views p.numel() reals at offsets that count one real per
    element: through those, most of a complex bucket went unaveraged. DDP buckets each dtype apart, so a bucket
    is all complex or all real."""
    grads, params = bucket.gradients(), bucket.parameters()
    if not any(p.is_complex() for p in params):
        return grads
    buf, off, views = bucket.buffer(), 0, []
    for p in params:
        views.append(buf.narrow(0, off, 2 * p.numel()).view(*p.shape, 2))
        off += 2 * p.numel()
    if off != buf.numel():
        raise TernGradError(f"hvd_terngrad: DDP bucket {bucket.index()} of complex gradients holds {buf.numel()} "
                            f"reals where its parameters have {off}: a layout this hook does not know")
    return views


def _finite_average(markers: Markers, buf: torch.Tensor) -> bool:
    """Whether a bucket's average is finite, read where a marker can be (or all of it): where no rank sent more
    than sendable, nothing else can be non-finite."""
    if markers.values is not None:
        return all(map(math.isfinite, map(markers.values.__getitem__, markers.at)))
    return not nonfinite([buf if markers.where is None else buf.index_select(0, markers.where)])


def failed_average(index: int, named: list, me: int, step: int, exc) -> CollectiveTimeoutError:
    """The error of a bucket's fp32 average whose allreduce failed (named: its gradients, as state.gradients)."""
    return CollectiveTimeoutError(
        f"hvd_terngrad: the fp32 average of DDP bucket {index} ({named[0][0]!r} and {len(named) - 1} more) failed "
        f"on rank {me} at step {step} (a rank that never joined fails it after timeout_s): {exc}")


def nonfinite_averaged(named: list, mine: list, me: int, size: int, step: int, limit: Optional[float]
                        ) -> Optional[NonFiniteGradientError]:
    """A bucket's non-finite average, read in full: its non-finite tensors made NaN throughout, as the coded path
    hands them to AMP's GradScaler, and the error every rank raises for the first (None where limit is None:
    on_nonfinite="propagate"). named: its gradients, as TernGradState.gradients; mine: the indices of those this
    rank marked (finite.mark), one too small to carry any marker being ours."""
    bad = nonfinite([grad for _, grad in named])
    error = None
    if limit is not None:
        first = bad[0]  # whose marker it carries
        culprit = marked_rank(named[first][1], size)
        error = nonfinite_average(named[first][0], me if culprit < 0 and first in mine else culprit, step, me,
                                  limit * size)
    for i in bad:
        named[i][1].fill_(float("nan"))
    return error


_FP32_MAX = torch.finfo(torch.float32).max


def sendable(size: int) -> float:
    """The largest |value| a rank sends in a bucket it averages itself (OwnAverages.start): `size` of them sum
    to at most half of fp32's largest, with room for any rounding, so no finite average overflows. A larger
    one, a gradient within a factor 2 of fp32's largest, counts as an overflow, as AMP's GradScaler counts the
    Inf it would soon be."""
    return _FP32_MAX / (2 * size)


def _divide(buf: torch.Tensor, size: int, scale) -> float:
    """buf * (1/size) in place, before the allreduce, and its largest |value| after (NaN where it holds one),
    in one pass of the codec. DDP's own allreduce scales so (its reducer multiplies each gradient by 1/size as
    it copies it into the bucket), and so the average is DDP's to the bit for any world size. There backward
    has just written the bucket and it is in cache; after the sum, the division ran on gloo's thread over a
    buffer gloo had just written, on the step's critical path (measured: docs/notes/tta-log.md, "The DDP
    hook's own fp32 averages"). scale: the codec backend's (Backend.scale; buf is contiguous fp32)."""
    return scale(buf, 1.0 / size)

