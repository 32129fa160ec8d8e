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
