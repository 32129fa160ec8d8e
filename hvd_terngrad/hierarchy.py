"""hierarchical=True: average inside each node in float, code only between nodes.

The paper's clusters had 4 GPUs a node. Inside a node the links (NVLink, PCIe, shared memory) are one or two
orders of magnitude faster than the network, so ternary codes buy nothing there and cost a draw's variance.
For each bucket k of coded tensors, on nodes of L ranks each:

    1. a float Average allreduce of the bucket's gradients over the node's ranks (its local process set);
    2. the node's rank with local index k mod L codes that node average with the configured transport, over
       the cross process set of the ranks with that local index (one per node);
    3. it broadcasts the decoded average to its node.

Buckets take turns over the local ranks, so each rank codes about 1/L of the model and every cross set
carries its part. A node's link still carries one transport's bytes for N = nodes, whichever rank sends
them. It stays unbiased: with equal nodes the mean of the node means is the global mean, and TernGrad's
codes are unbiased for each node mean. One node: step 1 is the whole exchange. One rank a node: the flat
path.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import torch

from hvd_terngrad.finite import nonfinite


@dataclass(frozen=True)
class Topology:
    node: int  # this rank's node, 0..nodes-1
    nodes: int
    local_index: int  # this rank's place in its node, 0..local_size-1
    local_size: int
    grid: tuple[tuple[int, ...], ...]  # the global ranks of every node, by node and local index

    @property
    def node_ranks(self) -> tuple[int, ...]:
        return self.grid[self.node]

    def coder(self, bucket: int) -> int:
        """The local index of the rank that codes bucket `bucket` for its node."""
        return bucket % self.local_size


def topology(table: list[tuple[int, int]], rank: int) -> Topology:
    """This rank's Topology from every rank's (node, local index), in global rank order (Horovod's cross_rank
    and local_rank). ValueError when the nodes differ in size: the mean of node means would then weigh the
    ranks of small nodes more."""
    nodes = sorted({node for node, _ in table})
    members = {n: sorted(((i, r) for r, (node, i) in enumerate(table) if node == n)) for n in nodes}
    sizes = {n: len(m) for n, m in members.items()}
    if len(set(sizes.values())) != 1 or any([i for i, _ in m] != list(range(len(m))) for m in members.values()):
        raise ValueError(f"hierarchical=True needs the same number of ranks on every node, with local ranks "
                         f"0..L-1; Horovod reports ranks per node {dict(sorted(sizes.items()))}")
    node, local_index = table[rank]
    return Topology(node=nodes.index(node), nodes=len(nodes), local_index=local_index, local_size=sizes[node],
                    grid=tuple(tuple(r for _, r in members[n]) for n in nodes))


class Hierarchy:
    """This rank's two groups as TernGrad collectives (Horovod's process sets, or torch.distributed's groups):
    `local` (its node; None with one rank a node) and `cross` (its local index on every node; None with one
    node)."""

    __slots__ = ("topology", "local", "cross")

    def __init__(self, topo: Topology, local, cross):
        self.topology, self.local, self.cross = topo, local, cross

    def codes(self, bucket: int) -> bool:
        """Whether this rank codes bucket `bucket` between the nodes."""
        return self.cross is not None and self.topology.coder(bucket) == self.topology.local_index

    def average_in_node(self, named: list[tuple[str, torch.Tensor]]) -> list:
        """Step 1 for one bucket: start the float Average of its gradients over the node, in place."""
        return [(name, self.local.average_async_(g, name=f"terngrad.node.{name}")) for name, g in named]

    def averaged_in_node(self, handles: list) -> bool:
        return all(self.local.poll(h) for _, h in handles)

    def wait_in_node(self, handles: list) -> None:
        for name, h in handles:
            self.local.wait(h, f"the node average of {name!r}")

    def finish_in_node(self, coded: list[tuple[int, str, torch.Tensor]], bad: set[str]) -> list[str]:
        """Step 3: each (bucket, name, average) from the rank that coded its bucket to the rest of the node, in
        place; the names whose average is non-finite, the same on every rank. `bad`: the coded tensors this
        rank found non-finite, which it fills with NaN first. Any other decoded average is finite, so one
        element tells (a scan of a large tensor costs as much as its broadcast). One node: its float average
        was the whole exchange, so the check is a scan."""
        if self.cross is None:
            return [coded[i][1] for i in nonfinite([t for _, _, t in coded])]
        for _, name, t in coded:
            if name in bad:
                t.fill_(float("nan"))
        handles = [(name, t, self.local.broadcast_async_(t, self.root(k), name=f"terngrad.node.bcast.{name}"))
                   for k, name, t in coded]
        out = []
        for name, t, h in handles:
            self.local.wait(h, f"the node broadcast of {name!r}")
            if not math.isfinite(t.reshape(-1)[0].item()):
                out.append(name)
        return out

    def root(self, bucket: int) -> int:
        """The coder of `bucket` as Horovod's and torch.distributed's broadcasts name a root within a group:
        its global rank."""
        return self.topology.node_ranks[self.topology.coder(bucket)]


def discover(timeout_s: float, stats=None) -> Hierarchy:
    """Every rank's node from Horovod (one allgather over all ranks, at most timeout_s) and the process sets
    of the hierarchy, registered with Horovod where they are new. Every rank must call this, in the same
    order as any other process-set registration."""
    import horovod.torch as hvd

    from hvd_terngrad.collectives.horovod import HorovodCollectives

    world = HorovodCollectives(hvd.global_process_set, stats, timeout_s)
    mine = torch.tensor([[hvd.cross_rank(), hvd.local_rank()]], dtype=torch.int32)
    table = world.wait(hvd.allgather_async(mine, name="terngrad.topology"), "the node-topology allgather")
    topo = topology([tuple(row) for row in table.tolist()], hvd.rank())
    node_sets, cross_sets = _register(topo)
    return Hierarchy(topo, None if topo.local_size == 1 else HorovodCollectives(node_sets[topo.node], stats, timeout_s),
                     None if topo.nodes == 1 else HorovodCollectives(cross_sets[topo.local_index], stats, timeout_s))


def discover_torch(timeout_s: float, stats=None) -> Hierarchy:
    """The same over torch.distributed's default group: each rank's node is torchrun's GROUP_RANK (the node
    rank it gives every process) or else its host name, its place in the node LOCAL_RANK or else its order
    among the node's ranks (one all_gather_object); the node and cross groups from
    dist.new_subgroups_by_enumeration, which every rank calls with the same lists."""
    import torch.distributed as dist

    from hvd_terngrad.collectives.distributed import TorchCollectives

    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (node, os.environ.get("LOCAL_RANK")))
    nodes = list(dict.fromkeys(n for n, _ in every))  # in order of first appearance
    table = []
    for r, (n, local) in enumerate(every):
        table.append((nodes.index(n), int(local) if local is not None else [m for m, _ in every[:r]].count(n)))
    topo = topology(table, dist.get_rank())
    local = cross = None
    if topo.local_size > 1:
        group, _ = dist.new_subgroups_by_enumeration([list(row) for row in topo.grid])
        local = TorchCollectives(group, stats, timeout_s)
    if topo.nodes > 1:
        group, _ = dist.new_subgroups_by_enumeration([[row[i] for row in topo.grid] for i in range(topo.local_size)])
        cross = TorchCollectives(group, stats, timeout_s)
    return Hierarchy(topo, local, cross)


def _register(topo: Topology) -> tuple[list, list]:
    """The process sets of every node and of every local index, in that order, each the one Horovod has or a
    new one. Every rank registers every set, also those it is not in: Horovod requires it."""
    grid = topo.grid
    node_sets = [_process_set(row) if topo.local_size > 1 else None for row in grid]
    cross_sets = [_process_set([row[i] for row in grid]) if topo.nodes > 1 else None for i in range(topo.local_size)]
    return node_sets, cross_sets


def _process_set(ranks: list[int]):
    """Horovod's process set of exactly `ranks`, registered if new (that needs HOROVOD_DYNAMIC_PROCESS_SETS=1)."""
    import horovod.torch as hvd
    from horovod.common import process_sets as _process_sets

    ranks = sorted(ranks)
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    # Horovod finds a set by its ranks only inside add_process_set, which refuses duplicates, so look first
    # in its table (a private call; hvd.init(process_sets=[...]) sets are found the same way)
    known = {tuple(r): i for i, r in _process_sets._basics._get_process_set_ids_and_ranks().items()}
    if tuple(ranks) in known:
        ps = hvd.ProcessSet(ranks)
        ps.process_set_id = known[tuple(ranks)]
        return ps
    try:
        return hvd.add_process_set(ranks)
    except ValueError as exc:
        raise ValueError(f"hvd_terngrad: hierarchical=True registers a process set per node and per local rank "
                         f"({ranks} for one): {exc}") from None
