"""N workers of hvd_terngrad.DistributedOptimizer in one process, bit for bit: what fidelity runs of 8 to 32
workers need on a machine with 2 cores.

    sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(transport="sharded"), n=8)
    for each step: grads = [worker r's gradients, in the model's parameter order, for r in range(8)]
                   sim.average(grads) -> the gradients every worker's optimizer applies

Each simulated rank runs the library's own pipeline (hvd_terngrad.pipeline) over loopback collectives
(hvd_terngrad.collectives.loopback), as each real rank runs it over Horovod's: its Philox stream, its
error-feedback residuals, its owner residuals. A step does what the optimizer does, in its order:
- the optimizer's buckets (hvd_terngrad.buckets.plan_buckets), each through every rank's pipeline, keyed as
  the optimizer keys them; every rank decodes the same bytes, so rank 0's decode serves all;
- float pass-through tensors averaged by the loopback as Horovod's Average over MPI does (in the order of
  recursive doubling, then times 1/N in double; collectives.loopback.horovod_average).

tests/test_frontends.py holds it to the golden parameters of real horovodrun jobs of 2 and 4 ranks, bit for
bit, for every transport.
"""
from __future__ import annotations

import torch

from hvd_terngrad import TernGradConfig
from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from hvd_terngrad.collectives.loopback import LoopbackWorld
from hvd_terngrad.errors import NonFiniteGradientError
from hvd_terngrad.pipeline import Pipeline, exchange


class SimulatedWorkers:
    """The exchange of N ranks of hvd_terngrad.DistributedOptimizer (default bucket_bytes, the global
    process set), one step per average()."""

    def __init__(self, named_parameters, config: TernGradConfig, n: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if config.hierarchical:
            raise ValueError("the simulator has no nodes: hierarchical=True is not simulated")
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        self.names = [name for name, _ in named]
        self.config, self.n = config, n
        self.comms = LoopbackWorld(n, timeout_s=config.timeout_s).ranks()
        self.pipes = [Pipeline(config, c) for c in self.comms]
        self.buckets, self.floats = plan_buckets([(name, p.numel(), p.element_size()) for name, p in named],
                                                 config, bucket_bytes)

    def average(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Every rank's gradients (grads[r][i]: rank r, parameter i in named order) -> the averaged gradient
        of each parameter, as every rank's optimizer holds it after synchronize()."""
        if len(grads) != self.n or any(len(g) != len(self.names) for g in grads):
            raise ValueError(f"need {self.n} lists of {len(self.names)} gradients")
        out: list[torch.Tensor | None] = [None] * len(self.names)
        if self.n == 1:  # as the optimizer: one rank does not touch its gradients
            return list(grads[0])
        try:
            bad = []
            for k, members in enumerate(self.buckets):
                named = [[(self.names[i], grads[r][i]) for i in members] for r in range(self.n)]
                groups, avgs = exchange(self.pipes, f"bucket.{k}", named, decode_ranks=(0,))
                bad += [it.name for it in self.pipes[0].nonfinite(groups[0])]
                for i, avg in zip(members, avgs[0]):
                    out[i] = avg.view(grads[0][i].shape).to(grads[0][i].dtype)
            bad += self._floats(grads, out)
            if bad:
                raise NonFiniteGradientError(f"simulated step {self.pipes[0].step}: non-finite average in "
                                             f"{bad[0]!r}")
        finally:
            for p in self.pipes:
                p.next_step()
        return out

    def _floats(self, grads, out) -> list[str]:
        """The float pass-through tensors, averaged as Horovod does; the names of those non-finite."""
        bad = []
        for i in self.floats:
            handles = [c.average_async_(grads[r][i].clone(), name=f"float.{self.names[i]}")
                       for r, c in enumerate(self.comms)]
            out[i] = self.comms[0].wait(handles[0], f"the float average of {self.names[i]!r}")
            for c, h in zip(self.comms[1:], handles[1:]):
                c.wait(h, "")
            if not bool(torch.isfinite(out[i]).all()):
                bad.append(self.names[i])
        return bad


class SimulatedPowerSGD:
    """N workers of DDP with torch's powerSGD_hook (Vogels et al., NeurIPS 2019) in one process, for the
    fidelity suite: the hook's algorithm step for step, with torch's own helpers (_should_compress,
    _orthogonalize) and its RNG, over one DDP bucket that holds every parameter in reverse order (DDP's order).

    Per step, before start_iter: the plain average (each gradient divided by N, then summed, as the hook's
    allreduce does). From start_iter on, each worker adds its error to its gradient; the tensors worth
    compressing at `rank` (min_compression_rate) are each approximated by P Q^T, with P = sum_r M_r Q
    orthogonalized and Q = mean_r M_r^T P; the rest are averaged; each worker keeps as its error what it put in
    less what came back. Q starts random (the hook's seed draw, in the hook's order: tensors grouped by shape)
    and is reused, orthogonalized, on later steps (warm start). tests/test_fidelity_suite.py holds it to the
    real hook on 2 gloo ranks, bit for bit.
    """

    def __init__(self, named_parameters, n: int, rank: int = 1, start_iter: int = 2,
                 min_compression_rate: float = 2.0, seed: int = 0, order: list[int] | None = None):
        """order: the parameter indices in the bucket's order (default: reversed, as DDP plans them)."""
        import numpy as np
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        shapes = [p.shape for _, p in named_parameters if p.requires_grad]
        self.order = list(order) if order is not None else list(range(len(shapes)))[::-1]
        self.shapes = [shapes[i] for i in self.order]  # by bucket position
        self.n, self.rank, self.start_iter = n, rank, start_iter
        self.rng = np.random.RandomState(seed)  # as PowerSGDState's
        self.iter = 0
        # bucket positions of the tensors worth compressing, in the hook's order: grouped by shape
        worth = [k for k, s in enumerate(self.shapes)
                 if _should_compress(s[0], s.numel() // s[0], min(s[0], s.numel() // s[0], rank),
                                     min_compression_rate)[0]]
        groups: dict = {}
        for k in worth:
            groups.setdefault(self.shapes[k], []).append(k)
        self.compressed = [k for ks in groups.values() for k in ks]
        self.errors: list[torch.Tensor | None] = [None] * n  # each worker's error, in the bucket's layout
        self.qs: list[torch.Tensor] | None = None  # the mean Q of each compressed tensor, for the warm start

    def average(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """grads[r][i]: worker r's gradient of parameter i -> the average every worker applies."""
        bucket = [torch.cat([g[i].reshape(-1) for i in self.order]) for g in grads]
        if self.iter < self.start_iter:
            out = _sum([b.div(self.n) for b in bucket])
        else:
            out = self._powersgd(bucket)
        self.iter += 1
        avg: list[torch.Tensor | None] = [None] * len(self.order)
        for i, v in zip(self.order, self._views(out)):
            avg[i] = v.clone()
        return avg

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The bucket's tensors as views of `flat`, by bucket position."""
        views, off = [], 0
        for s in self.shapes:
            views.append(flat[off: off + s.numel()].view(s))
            off += s.numel()
        return views

    def _powersgd(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        for b, e in zip(bucket, self.errors):  # error feedback
            if e is not None:
                b.add_(e)
        kept = [b.clone() for b in bucket]
        views = [self._views(b) for b in bucket]
        plain = [k for k in range(len(self.shapes)) if k not in self.compressed]
        rest = _sum([torch.cat([vs[k].reshape(-1) for k in plain] or [b.new_empty(0)])
                     for vs, b in zip(views, bucket)]).div_(self.n)
        mats = [[vs[k].view(1, vs[k].shape[0], -1) for k in self.compressed] for vs in views]
        if self.qs is None:  # the first compressed step: random Q, seeded as the hook seeds it
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                self.qs = []
                for m in mats[0]:
                    q = torch.randn(1, m.shape[2], min(m.shape[1], m.shape[2], self.rank), dtype=m.dtype)
                    _orthogonalize(q)
                    self.qs.append(q)
        else:
            for q in self.qs:
                _orthogonalize(q)
        ps = [_sum([torch.bmm(mr[j], q) for mr in mats]) for j, q in enumerate(self.qs)]
        for p in ps:
            _orthogonalize(p)
        self.qs = [_sum([torch.bmm(mr[j].transpose(1, 2), p) for mr in mats]).div_(self.n)
                   for j, p in enumerate(ps)]
        out = torch.empty_like(bucket[0])
        pieces = self._views(out)
        off = 0
        for k in plain:
            pieces[k].copy_(rest[off: off + pieces[k].numel()].view(pieces[k].shape))
            off += pieces[k].numel()
        for j, k in enumerate(self.compressed):
            pieces[k].copy_(torch.bmm(ps[j], self.qs[j].transpose(1, 2)).view(pieces[k].shape))
        self.errors = [cp - out for cp in kept]
        return out


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order (an allreduce's; on 2 ranks every order gives the same bits)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total
