"""N workers of hvd_terngrad.DistributedOptimizer in one process, bit for bit: what fidelity runs of 8 to 32
workers need on a machine with 2 cores.

    sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(transport="sharded"), n=8)
    for each step: grads = [worker r's gradients, in the model's parameter order, for r in range(8)]
                   sim.average(grads) -> the gradients every worker's optimizer applies

Each simulated rank has its own TernGradEngine, as each real rank has (its Philox stream, its error-feedback
residuals, its owner residuals). A step does what the optimizer and Horovod do, in their order:
- the optimizer's buckets (hvd_terngrad.buckets.plan_buckets), each prepared on every rank;
- with shared scalers, the Max of the ranks' scaler vectors (Horovod's Max allreduce);
- the bucket's transport from the one table (hvd_terngrad.transports), its payload encoded on every rank
  and exchanged as the collective would: payloads concatenated in rank order (allgather), code values
  summed (the summed transports: integers, exact in any order), shard j of every rank's stream to owner j
  and the owners' replies concatenated (sharded, sharded-ternary); then decoded once, since every rank
  decodes the same bytes;
- float pass-through tensors summed in the order of Open MPI's recursive doubling, ((g0 + g1) + (g2 + g3))
  ..., then scaled by 1/N in double as Horovod's Average does. Open MPI takes that order for small
  payloads on a power-of-two number of ranks; other cases may differ from a real job in the last bit of
  those tensors only.

tests/test_simulator.py holds it to real horovodrun jobs of 2 and 4 ranks: the same parameters, bit for bit,
for every transport.
"""
from __future__ import annotations

import torch

from hvd_terngrad import TernGradConfig
from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from hvd_terngrad.engine import NonFiniteGradientError, TernGradEngine
from hvd_terngrad.transports import Allgather, Sharded, Summed, resolve_transport


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
        self.engines = [TernGradEngine(config, r, n) for r in range(n)]
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
                avgs, nonfinite = self._bucket(k, members, grads)
                bad += nonfinite
                for i, avg in zip(members, avgs):
                    out[i] = avg.view(grads[0][i].shape).to(grads[0][i].dtype)
            for i in self.floats:
                out[i] = horovod_average([g[i] for g in grads])
                if not bool(torch.isfinite(out[i]).all()):
                    bad.append(self.names[i])
            if bad:
                raise NonFiniteGradientError(f"simulated step {self.engines[0].step}: non-finite average in "
                                             f"{bad[0]!r}")
        finally:
            for e in self.engines:
                e.next_step()
        return out

    def _bucket(self, k: int, members: list[int], grads) -> tuple[list[torch.Tensor], list[str]]:
        cfg, n = self.config, self.n
        items = [[e.prepare(self.names[i], grads[r][i]) for i in members] for r, e in enumerate(self.engines)]
        if cfg.share_scaler:
            reduced = torch.stack([e.scaler_vector(it) for e, it in zip(self.engines, items)]).max(dim=0).values
            for e, it in zip(self.engines, items):
                e.apply_shared(it, reduced)
        t = resolve_transport(cfg.transport, sum(it.numel for it in items[0]), n, int8=True, link=cfg.link())
        payloads = [t.encode(e, it) for e, it in zip(self.engines, items)]
        key = f"bucket.{k}"  # the optimizer's name of the group, which keys an owner's draw
        if isinstance(t, Sharded):
            received = torch.cat([t.owner_reply(t.owner_rows(payloads, j), payloads[j], j, n, key) for j in range(n)])
        elif isinstance(t, Summed):  # integers: exact in the payload's dtype, whatever the order
            received = torch.stack(payloads).sum(dim=0, dtype=payloads[0].dtype)
        elif isinstance(t, Allgather):
            received = torch.cat(payloads)
        else:
            raise ValueError(f"the simulator does not know transport {t.name!r}")
        avgs = t.decode(self.engines[0], items[0], received)
        return avgs, [it.name for it in self.engines[0].nonfinite(items[0])]


def horovod_average(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Horovod's Average over MPI: a Sum allreduce, here in recursive doubling's order, then times 1/N."""
    level = list(tensors)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return (level[0].double() * (1.0 / len(tensors))).to(tensors[0].dtype)
