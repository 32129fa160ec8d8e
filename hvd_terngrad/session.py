"""Session: one front end's TernGrad on one rank.

Every front end builds its own: the stock compressor (hvd_terngrad.compression), hvd_terngrad's optimizer
(hvd_terngrad.optimizer) and the DDP hook (hvd_terngrad.ddp). None imports another; what they share is this
object, which binds a frozen configuration to the ranks it averages over, in the manner of a spec that
`reify(process_group)` binds:

    session = Session(config, world)                       # any Collectives
    session = Session.horovod(config, process_set=None)    # Horovod's
    session.pipeline.start(...); session.plan; session.pipeline.stats; session.pipeline.state_dict()

With hierarchical=True the pipeline codes between the nodes, as this rank's node (hvd_terngrad.hierarchy), and
`world` still carries what passes through uncoded.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.pipeline import Pipeline, StepPlan

if TYPE_CHECKING:
    from hvd_terngrad.collectives import Collectives
    from hvd_terngrad.hierarchy import Hierarchy


class Session:
    """A front end's configuration, collectives, nodes and pipeline on one rank.

    Args:
        config: the frozen options (TernGradConfig).
        world: the collectives over every rank the front end averages over.
        hierarchy: with hierarchical=True, this rank's node and its groups (hierarchy.discover or discover_torch);
            None: the flat exchange over `world`.
        blocking_ok: whether transport="auto" may choose a transport whose collective blocks (summed-int8 under
            Horovod). A front end that finishes its groups in the same order on every rank says yes; the stock
            compressor, which finishes them in its rank's order of compress() calls, says no.
    """

    __slots__ = ("config", "world", "hierarchy", "pipeline")

    def __init__(self, config: TernGradConfig, world: Collectives, hierarchy: Hierarchy | None = None,
                 blocking_ok: bool = True):
        self.config = config  # frozen: every rank's the same, or the payload headers refuse the codes
        self.world = world  # every rank of the front end's group: the uncoded averages, the step's verdicts
        self.hierarchy = hierarchy  # hierarchical=True: the node and cross groups; else None
        if hierarchy is None:
            pipe = Pipeline(config, world, blocking_ok=blocking_ok)
        else:  # one node: nothing is coded, and the world stands in for the cross group
            topo = hierarchy.topology
            pipe = Pipeline(config, hierarchy.cross or world, rank=topo.node, size=topo.nodes, blocking_ok=blocking_ok)
        self.pipeline = pipe  # this rank's coded exchange: its coder, its step, transport="auto"'s planner
        for comm in (world, None if hierarchy is None else hierarchy.local):
            if comm is not None:
                comm.stats = pipe.stats  # every collective counts its waits into the step's stats

    @classmethod
    def horovod(cls, config: TernGradConfig, process_set=None, blocking_ok: bool = True) -> Session:
        """A session over a Horovod process set (None: the global one). With hierarchical=True this discovers
        the nodes: an allgather over all ranks and process-set registrations, so every rank must build its
        session, in the same order as any other process-set registration.

        Raises:
            ValueError: this rank is not in `process_set`, or hierarchical=True on a process set other than the
                global one (its nodes are Horovod's).
        """
        import horovod.torch as hvd

        import hvd_terngrad.hierarchy as hierarchy
        from hvd_terngrad.collectives.horovod import HorovodCollectives, describe_process_set, process_set_id

        world = HorovodCollectives(process_set, timeout_s=config.timeout_s)
        if process_set_id(world.process_set) != 0 and not world.process_set.included():
            raise ValueError(f"rank {hvd.rank()} is not in {describe_process_set(world.process_set)}, the TernGrad "
                             f"compressor's: pass the optimizer's process_set= to TernGrad")
        nodes = None
        if config.hierarchical:
            if process_set_id(world.process_set) != 0:
                raise ValueError("hierarchical=True works on the global process set: its nodes are Horovod's")
            nodes = hierarchy.discover(config.timeout_s)
        # auto weighs the int8 sums only where they can run: on the global process set, under MPI, with mpi4py
        coded_over = world if nodes is None or nodes.cross is None else nodes.cross
        return cls(config, world, nodes, blocking_ok and coded_over.int8_refusal() is None)

    @property
    def plan(self) -> StepPlan:
        """This step's plan: which groups are coded, with which transport, and the wire of the rest."""
        return self.pipeline.plan
