"""TernGrad's transports: how one group of coded tensors travels between ranks, one class each, one table.

Adding a transport is a module with its class (its layout, its collectives and its cost; see base.Transport)
and a row in TRANSPORTS. Both Horovod front ends, the DDP hook, transport="auto", the performance model and the
benchmarks read the table. Nothing here imports a framework: the collectives are handed in.
"""
from __future__ import annotations

from hvd_terngrad.commcost import Link
from hvd_terngrad.transports.allgather import Allgather
from hvd_terngrad.transports.base import RECORD_PADDING_BYTES, Transport
from hvd_terngrad.transports.sharded import OWNER_RANK_BASE, Sharded, ShardedTernary
from hvd_terngrad.transports.summed import Summed, SummedInt8

__all__ = ["TRANSPORTS", "Transport", "Allgather", "Summed", "SummedInt8", "Sharded", "ShardedTernary",
           "RECORD_PADDING_BYTES", "OWNER_RANK_BASE", "choose_transport", "resolve_transport", "crossover_nodes"]

TRANSPORTS: dict[str, Transport] = {t.name: t for t in (Allgather(), Summed(), SummedInt8(), Sharded(),
                                                          ShardedTernary())}


def choose_transport(numel: int, n_workers: int, link: Link | None = None, int8: bool = False) -> str:
    """The cheapest transport for a bucket of `numel` coded elements under commcost's model (int8: whether the
    caller can run the blocking ones), among those whose average is the allgather's."""
    link = link or Link()
    cands = [t for t in TRANSPORTS.values()
             if t.auto_ok and n_workers <= t.max_workers and (int8 or not t.blocking)]
    return min(cands, key=lambda t: t.seconds(numel, n_workers, link)).name


def resolve_transport(configured: str, numel: int, n_workers: int, int8: bool, link: Link | None = None) -> Transport:
    """The transport a group of `numel` coded elements takes: the configured one, or for "auto" the model's
    choice on `link`."""
    if configured == "auto":
        configured = choose_transport(numel, n_workers, link, int8=int8)
    return TRANSPORTS[configured]


def crossover_nodes(numel: int, link: Link | None = None, summed: str = "summed", max_nodes: int = 4096) -> int:
    """The smallest N at which `summed` beats the allgather for a tensor of `numel` elements."""
    link = link or Link()
    fast, base = TRANSPORTS[summed], TRANSPORTS["allgather"]
    for n in range(2, max_nodes + 1):
        if fast.seconds(numel, n, link) < base.seconds(numel, n, link):
            return n
    return max_nodes + 1
