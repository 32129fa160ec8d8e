"""In-process ranks for tests: the library's pipeline over loopback collectives, with what each rank received.

    run = exchange(2, [[("w", g0)], [("w", g1)]], share_scaler=False)
    run.pipes[r], run.groups[r], run.averages[r], run.received(r, "allgather")

The tests that corrupt bytes decode again from a copy of what a rank received, through the transport itself
(run.decode(r, bytes)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hvd_terngrad import TernGradConfig
from hvd_terngrad.collectives.loopback import LoopbackCollectives, LoopbackWorld
from hvd_terngrad.pipeline import Group, Pipeline
from hvd_terngrad.pipeline import exchange as _exchange


class Tap(LoopbackCollectives):
    """A loopback rank that keeps a copy of each collective's output, by kind (max, allgather, sum, alltoall)."""

    def __init__(self, world, rank):
        super().__init__(world, rank)
        self.got: dict[str, torch.Tensor] = {}

    def wait(self, handle, what):
        out = super().wait(handle, what)
        self.got[handle.kind] = out.clone()
        return out


@dataclass
class Run:
    pipes: list[Pipeline]
    groups: list[Group]
    averages: list[list[torch.Tensor]]

    def received(self, rank: int, kind: str) -> torch.Tensor:
        return self.pipes[rank].comm.got[kind]

    def decode(self, rank: int, received: torch.Tensor) -> list[torch.Tensor]:
        g = self.groups[rank]
        return g.transport.decode(self.pipes[rank].coder, g.items, received)


def pipelines(n: int, configs) -> list[Pipeline]:
    """n ranks of one loopback world; configs: one TernGradConfig for all, or one a rank."""
    world = LoopbackWorld(n)
    configs = configs if isinstance(configs, list) else [configs] * n
    return [Pipeline(cfg, Tap(world, r)) for r, cfg in enumerate(configs)]


def exchange(n: int, named: list[list[tuple[str, torch.Tensor]]], key: str = "g", config=None, step: int = 0,
             **options) -> Run:
    """One group of tensors (named[r]: rank r's) through n in-process ranks at `step`; every rank decodes."""
    pipes = pipelines(n, config if config is not None else TernGradConfig(**options))
    for p in pipes:
        p.coder.step = step
    groups, averages = _exchange(pipes, key, named)
    return Run(pipes, groups, averages)
