"""The calibrated timeline: one training step on an emulated cluster, replayed from measured parts.

The emulated cluster's N nodes share this machine's cores and TCP stack, so benchmarks/calibrate.py measures
its parts on it, without training: compute of N workers at once and when each gradient is ready within
backward; each transport's encode/decode; and each collective's time against payload size, alone
and beside compute, plus how much it slows that compute.

A step is replayed as a timeline (host_step_seconds): gradients become ready; one Horovod channel runs the
collectives in order, fusing the waiting requests of one collective, dtype and reduce op as Horovod does;
TernGrad buckets share scalers, encode and send their codes, and synchronize() decodes. A collective runs at
its measured pace beside compute, at its size, while backward runs or the main thread encodes or decodes.
The overlap is what the timeline hides behind that work.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.models import param_sizes
from hvd_terngrad import TernGradConfig
from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from hvd_terngrad.transports import TRANSPORTS
from hvd_terngrad.wire import SCALER_ENTRY_BYTES

FUSION_BYTES = 64 << 20  # Horovod's default fusion threshold


class Curve:
    """Seconds against size, through measured points (piecewise linear, extended by the last segment's slope),
    which keeps the token-bucket burst of small messages and the TCP losses of large ones that one latency +
    bandwidth pair averages away. Below the smallest size the time stays flat (a call's fixed cost), or with
    origin=True falls to 0 in proportion (work per element)."""

    def __init__(self, points: list[tuple[float, float]], origin: bool = False):
        self.pts = sorted((float(b), float(t)) for b, t in points)
        if origin:
            self.pts.insert(0, (0.0, 0.0))

    def __call__(self, nbytes: float) -> float:
        pts = self.pts
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


@dataclass(frozen=True)
class Host:
    """One calibrated (profile, N) cluster."""

    nodes: int
    compute: dict  # "model:batch" -> {"step": s, "backward": s}
    codec: dict  # transport -> {"encode": Curve, "decode": Curve} of seconds against bucket elements
    curves: dict  # collective kind -> Curve of seconds against bytes per worker
    beside: dict = field(default_factory=dict)  # collective kind -> Curve of its seconds beside compute
    cpu: dict = field(default_factory=dict)  # collective kind -> Curve of how much it slows compute (0..1)

    @classmethod
    def from_json(cls, cal: dict) -> Host:
        codec = {t: {k: Curve(pts, origin=True) for k, pts in v.items()} for t, v in cal["codec"].items()}
        colls = cal["collectives"]
        return cls(cal["nodes"], cal["compute"], codec, {k: Curve(v["points"]) for k, v in colls.items()},
                   {k: Curve(v["beside_compute_points"]) for k, v in colls.items() if "beside_compute_points" in v},
                   {k: Curve(v["cpu_fraction_points"]) for k, v in colls.items() if "cpu_fraction_points" in v})

    def beside_compute(self, kind: str, nbytes: float, alone: float) -> tuple[float, float]:
        """(stretch >= 1, cpu_fraction 0..1) of a `kind` call of `nbytes` that takes `alone` seconds by itself,
        as measured at its size; a kind not measured beside compute neither slows nor is slowed."""
        r = max(1.0, self.beside[kind](nbytes) / alone) if kind in self.beside else 1.0
        f = min(1.0, max(0.0, self.cpu[kind](nbytes))) if kind in self.cpu else 0.0
        return r, f


@dataclass
class _Request:
    t: float  # submitted
    seq: int
    kind: str  # collective and dtype: allreduce_fp32, allgather_u8, ...
    nbytes: float
    done: object  # called with the time the (fused) call ends, or None
    fuse: str | None  # requests with the same key (collective, dtype and reduce op) fuse


class Timeline:
    """One step's clock: the Horovod channel's queue, the main thread, and backward's end, which moves later
    as main-thread work or collectives beside it delay backward."""

    def __init__(self, host: Host, fwd: float, bwd: float):
        self.host = host
        self.fwd, self.bwd = fwd, bwd
        self.queue: list[_Request] = []
        self.seq = 0
        self.bwd_end = fwd + bwd
        self.main_free = 0.0  # when the main thread is next free (after backward)
        self.comm = self.codec = 0.0  # seconds spent, in total
        self.decoded = 0  # results synchronize() has taken, in order
        self.stalls: list[tuple[float, float]] = []  # main-thread codec work after backward
        self.done_at: dict = {}
        self.last_end = 0.0

    def submit(self, t: float, kind: str, nbytes: float, done=None, fuse: str | None = None) -> None:
        self.queue.append(_Request(t, self.seq, kind, nbytes, done, fuse))
        self.seq += 1

    def in_order(self, costs: list[float]) -> None:
        """synchronize() takes the results in order (done_at[("sent", k)]): each, once it has arrived and
        the main thread is free, costs costs[k] of main-thread work beside the collectives still in flight."""
        while self.decoded < len(costs) and ("sent", self.decoded) in self.done_at:
            k = self.decoded
            t0 = max(self.bwd_end, self.main_free, self.done_at[("sent", k)])
            self.stalls.append((t0, t0 + costs[k]))
            self.main_free = t0 + costs[k]
            self.decoded += 1

    def run(self, trace: list | None = None) -> None:
        """Run the channel until no request is left; callbacks may submit more."""
        chan = 0.0
        while self.queue:
            self.queue.sort(key=lambda q: (q.t, q.seq))
            req = self.queue.pop(0)
            start = max(chan, req.t)
            nbytes, dones = self._fuse(req, start)
            chan = self._call(req.kind, nbytes, start)
            self.last_end = max(self.last_end, chan)
            if trace is not None:
                trace.append((start, chan, req.kind, nbytes, self.bwd_end))
            for done in dones:
                if done is not None:
                    done(chan)

    def _fuse(self, req: _Request, start: float) -> tuple[float, list]:
        """What is waiting when the channel frees up and shares the request's key joins it (looking past
        others), up to Horovod's fusion threshold (an allgather's output counts)."""
        nbytes, dones = req.nbytes, [req.done]
        if not req.fuse:
            return nbytes, dones
        scale = self.host.nodes if req.kind.startswith("allgather") else 1
        i = 0
        while i < len(self.queue) and self.queue[i].t <= start:
            q = self.queue[i]
            if q.fuse == req.fuse and q.kind == req.kind and (nbytes + q.nbytes) * scale <= FUSION_BYTES:
                nbytes += q.nbytes
                dones.append(q.done)
                self.queue.pop(i)
            else:
                i += 1
        return nbytes, dones

    def _call(self, kind: str, nbytes: float, start: float) -> float:
        """One (fused) call from `start`: its end. Beside backward the call runs `stretch` times slower and
        slows backward by `cpu_fraction`; main-thread codec work after backward slows it the same way."""
        cost = self.host.curves[kind](nbytes)
        self.comm += cost
        chan = start + cost
        r, f = self.host.beside_compute(kind, nbytes, cost)
        if start < self.bwd_end:
            beside = min(cost * r, self.bwd_end - start)  # seconds of the call spent beside backward
            self.bwd_end += f * beside
            chan = start + beside + (cost - beside / r)
        for s0, s1 in sorted(self.stalls):
            if s1 > start and s0 < chan:
                chan += (min(s1, chan) - max(s0, start)) * (1 - 1 / r)
        return chan


def submit_dense(tl: Timeline, method: str, params: list[tuple[str, int]], t_ready: dict, comp: dict) -> None:
    """FP32/fp16 through the stock optimizer: each gradient is allreduced when ready; fp16 casts it in the
    hook (backward waits) and back as synchronize() takes the results in order."""
    width = 4 if method == "fp32" else 2
    kind = "allreduce_fp32" if method == "fp32" else "allreduce_fp16"
    cast = tl.host.codec.get("fp16") if method == "fp16" else None
    # the job's own probe times the casts with training's allocations (fresh pages fault in); the
    # calibration's curves, on reused buffers, are the fallback
    casts = comp.get("fp16_casts") if method == "fp16" else None
    decs: list[float] = []

    def cast_back(i):
        def done(t):
            tl.done_at[("sent", i)] = t
            tl.in_order(decs)
        return done

    for n, numel in sorted(params, key=lambda q: t_ready[q[0]]):
        t = t_ready[n] + tl.bwd_end - (tl.fwd + tl.bwd)
        d = 0.0
        if cast:
            if casts:
                c, d = casts["encode"][n], casts["decode"][n]
            else:
                c, d = cast["encode"](numel), cast["decode"](numel)
            tl.bwd_end += c
            tl.codec += c + d
            t += c
        decs.append(d)
        tl.submit(t, kind, width * numel, cast_back(len(decs) - 1), fuse="average")


class TernGradStep:
    """hvd_terngrad.DistributedOptimizer on the timeline. Pass-through floats are allreduced when ready; a
    bucket, once all its gradients are ready, sends its scalers (Max allreduce), is encoded on the main thread
    at the first backward hook after they return, or in synchronize() (delaying backward if it is still
    running), then sends its codes (allgather, fp16 sum, or for the sharded transports an alltoall to the
    shard owners, whose replies, made at the next hook, travel in an allgather). synchronize() encodes what
    is left, then decodes the buckets in order as their codes arrive; int8 sums are a blocking MPI call there
    (finish())."""

    def __init__(self, tl: Timeline, transport: str, params: list[tuple[str, int]], t_ready: dict,
                 bucket_bytes: int):
        self.tl, self.transport = tl, TRANSPORTS[transport]
        self.codec = tl.host.codec.get(transport)
        needs = [self.transport.collective, self.transport.reply_collective or self.transport.collective]
        if self.codec is None or any(k not in tl.host.curves for k in needs):
            raise ValueError(f"the calibration has no curves for transport {transport!r} (benchmarks/calibrate.py "
                             f"measures {', '.join(tl.host.codec)}): the timeline cannot replay it")
        groups, floats = plan_buckets([(n, numel, 4) for n, numel in params], TernGradConfig(), bucket_bytes)
        for i in floats:
            n, numel = params[i]
            tl.submit(t_ready[n], "allreduce_fp32", 4 * numel, fuse="average")
        self.buckets = [[params[i] for i in g] for g in groups]
        self.elems = [sum(e for _, e in members) for members in self.buckets]
        self.hooks = sorted(set(t_ready.values()))
        self.decodes = [self.codec["decode"](e) for e in self.elems]
        if not self.transport.blocking:  # (a blocking transport's decodes follow its sums, in finish())
            tl.codec += sum(self.decodes)
        for b, members in enumerate(self.buckets):
            tl.submit(max(t_ready[n] for n, _ in members), "allreduce_fp32", SCALER_ENTRY_BYTES * len(members),
                      self._after_scaler(b), fuse="max")

    def _next_poll(self, t: float) -> float:
        """The optimizer looks at returned scalers from backward hooks and in synchronize(): the first hook at
        or after t (hooks move later as backward is delayed), else the end of backward."""
        tl = self.tl
        shift = tl.bwd_end - (tl.fwd + tl.bwd)
        return next((h + shift for h in self.hooks if h + shift >= t and h + shift < tl.bwd_end),
                    max(t, tl.bwd_end))

    def _main_work(self, t: float, cost: float) -> float:
        """Main-thread codec work that can start at t: at the next hook, once the main thread is free. In
        backward, backward waits for it; in synchronize(), the collectives in flight run beside it. Its end."""
        tl = self.tl
        t0 = max(self._next_poll(t), tl.main_free)
        tl.codec += cost
        if t0 < tl.bwd_end:
            tl.bwd_end += cost
        else:
            tl.stalls.append((t0, t0 + cost))
        tl.main_free = t0 + cost
        return t0 + cost

    def _after_scaler(self, b: int):
        def done(t):
            tl, tr, elems = self.tl, self.transport, self.elems[b]
            t1 = tl.done_at[("encoded", b)] = self._main_work(t, self.codec["encode"](elems))
            nbytes = tr.submitted_bytes(elems, len(self.buckets[b]))
            if tr.reply_collective:  # Horovod does not fuse alltoalls
                tl.submit(t1, tr.collective, nbytes, self._owned(b))
            elif not tr.blocking:
                tl.submit(t1, tr.collective, nbytes, self._sent(b), fuse=tr.name)
            self._drain()
        return done

    def _owned(self, b: int):
        """A sharded bucket's codes have reached their owners: this rank makes its shard's reply, then starts
        the reply allgather."""
        def done(t):
            tl, tr, elems = self.tl, self.transport, self.elems[b]
            t1 = self._main_work(t, self.codec["owner"](elems))
            tl.submit(t1, tr.reply_collective, tr.reply_submitted_bytes(elems, len(self.buckets[b]), tl.host.nodes),
                      self._sent(b), fuse="reply")
        return done

    def _sent(self, b: int):
        def done(t):
            self.tl.done_at[("sent", b)] = t
            self._drain()
        return done

    def _drain(self) -> None:
        """synchronize() encodes every bucket, then decodes them in order as their codes arrive: each decode
        is main-thread work beside the collectives still in flight."""
        tl = self.tl
        if not self.transport.blocking and all(("encoded", b) in tl.done_at for b in range(len(self.buckets))):
            tl.in_order(self.decodes)

    def finish(self, t: float) -> float:
        """synchronize()'s blocking collectives (the int8 sums), each followed by its decode, from t; else t."""
        if not self.transport.blocking:
            return t
        tl, tr = self.tl, self.transport
        for b, elems in enumerate(self.elems):
            cost = tl.host.curves[tr.collective](tr.submitted_bytes(elems, len(self.buckets[b])))
            dec = self.codec["decode"](elems)
            tl.comm += cost
            tl.codec += dec
            t = max(t, tl.done_at[("encoded", b)]) + cost + dec
        return t


def host_step_seconds(method: str, model: str, batch: int, host: Host, overlap: bool = True,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, compute: dict | None = None,
                      trace: list | None = None) -> dict:
    """One training step of `method` (fp32, fp16, terngrad, terngrad:summed, terngrad:summed-int8) on a
    calibrated host: {"compute", "codec", "comm", "overlap", "total"} in seconds.

    compute: the job's own compute probe (else the host's calibration of model:batch). overlap=False runs
    every collective after backward instead. `trace`, a list, receives each (fused) collective as (start,
    end, kind, bytes, end of backward so far)."""
    comp = compute or host.compute[f"{model}:{batch}"]
    fwd, bwd = comp["forward"], comp["backward"]
    update = max(0.0, comp["step"] - fwd - bwd)
    ready = comp.get("ready") or {}
    params = param_sizes(model)
    t_ready = {n: fwd + (ready.get(n, bwd) if overlap else bwd) for n, _ in params}
    tl = Timeline(host, fwd, bwd)
    tern = None
    if method.startswith("terngrad"):
        tern = TernGradStep(tl, method.partition(":")[2] or "allgather", params, t_ready, bucket_bytes)
    else:
        submit_dense(tl, method, params, t_ready, comp)
    tl.run(trace)
    t = max(tl.bwd_end, tl.main_free)
    if tern is not None:
        t = tern.finish(t)
    t = max(t, tl.last_end, tl.main_free) + update
    busy = comp["step"] + tl.codec + tl.comm
    return {"compute": comp["step"], "codec": tl.codec, "comm": tl.comm, "overlap": busy - t, "total": t}
