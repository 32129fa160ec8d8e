"""The TernGrad exchange, written once: prepare -> share the scalers -> transport -> decode, over any Collectives.

    pipe = Pipeline(config, comm)                  comm: Horovod, torch.distributed or loopback collectives
    g = pipe.start("bucket.0", [(name, grad), ...])    prepare; the scaler Max allreduce starts (share_scaler)
    pipe.progress(g)                               never blocks: moves g on where its collective is done
    averages = pipe.finish(g)                      waits (at most timeout_s), decodes: fp32, flat, per tensor
    pipe.next_step()

A group is the tensors that travel together: one tensor for the stock Horovod compressor, a bucket for
hvd_terngrad's optimizer and for DDP. Each rank's codes depend on (seed, step, rank, tensor name) and the
shared scaler, not on how tensors are grouped, so the front ends agree bit for bit.

Sharing the scalers: per tensor [s, f, t, -t] in one fp32 Max allreduce, f = rank + 1 where the tensor is
non-finite and t the low 24 bits of its tag (exact in fp32). After the Max, every rank knows the shared scaler
and which rank, if any, is non-finite; t != -(-t) means the ranks sent different tensors in that place. With
block scalers, every tensor's block scalers, in item order, go in a second Max allreduce, at 16 bits
(wire.block_scalers_carrier), started with the first.
"""
from __future__ import annotations

import enum
import time
from typing import NamedTuple

import torch

from hvd_terngrad import checkpoint
from hvd_terngrad.auto import PLAN_STEP, AutoPlan
from hvd_terngrad.coder import Coder, Item
from hvd_terngrad.collectives import Collectives
from hvd_terngrad.collectives.loopback import MirrorCollectives
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.errors import PayloadMismatchError
from hvd_terngrad.transports import TRANSPORTS, resolve_transport
from hvd_terngrad.transports.uncoded import UNCODED
from hvd_terngrad.wire import block_scalers_carrier, block_scalers_from_carrier


class Stage(enum.Enum):
    SCALER = "sharing its scalers"  # the Max allreduce is in flight
    SHARED = "ready to send"  # scalers known (or not shared); the transport has not started
    SENDING = "in its transport"  # the transport's collectives are in flight
    DONE = "finished"


class StepPlan(NamedTuple):
    """What this step does with each group, fixed at the last step's end (Pipeline.next_step) by transport="auto"
    (hvd_terngrad.auto), or by the configuration: every front end asks it, and nothing else, where a group goes.

    coded: the keys of the groups coded this step; None: every group.
    transport: the one transport of the coded groups; None: the configured one (auto: the model's choice per group).
    wire: what the uncoded groups travel in (transports.uncoded.WIRES).
    deciding: auto's trial is on: this step is measured, and its end may change the plan.
    """

    coded: frozenset | None = None
    transport: str | None = None
    wire: str = "fp32"
    deciding: bool = False

    @classmethod
    def of(cls, auto: AutoPlan | None) -> StepPlan:
        """The plan auto has in force (none: every group coded, as configured)."""
        if auto is None:
            return CODED
        return cls(None if auto.coded is None else frozenset(auto.coded), auto.transport, auto.wire,
                   not auto.decided)

    def uncoded(self, key: str) -> str | None:
        """The wire the group `key` goes uncoded in, as one average; None where it is coded."""
        return self.wire if self.coded is not None and key not in self.coded else None

    @property
    def all_uncoded(self) -> str | None:
        """The wire where every group goes uncoded this step, else None."""
        return self.wire if self.coded is not None and not self.coded else None


CODED = StepPlan()  # every group coded with the configured transport: the plan of every config but "auto"


class Group:
    """One group of tensors of one step on this rank, on its way through the pipeline."""

    __slots__ = ("key", "items", "what", "stage", "send_when_shared", "scaler_handle", "carries", "carrier",
                 "transport", "handle")

    def __init__(self, key: str, items: list[Item], what: str, send_when_shared: bool):
        self.key = key  # names its collectives, the same on every rank; keys a sharded-ternary owner's draw
        self.items = items
        self.what = what  # the group in messages: its first tensor, the one a user can look for
        self.stage = Stage.SHARED
        self.send_when_shared = send_when_shared  # start the transport as soon as the scalers are shared
        self.scaler_handle = None  # the scaler Max allreduce(s): (per tensor, block scalers or None)
        self.carries = 0  # the values of transport="auto"'s measurement its scaler vector carries (auto)
        self.carrier = None  # an fp32 group of auto's measured steps: the Max allreduce carrying the measurement
        self.transport = None
        self.handle = None  # of the transport's collectives


class Pipeline:
    """One rank's TernGrad exchange: prepare a group -> share its scalers -> its transport -> decode.

    Args:
        config: the options (TernGradConfig).
        comm: the collectives over the ranks that code (a collectives.Collectives).
        rank, size: this rank's place and the number of ranks that code (default: comm's; hierarchical coding
            passes the node's place among the nodes).
        blocking_ok: whether transport="auto" may choose a transport whose collective blocks (summed-int8 under
            Horovod); the stock compressor cannot wait in order and says no.
        rehearsal: a pipeline transport="auto" rehearses coding on (Pipeline.rehearse): no plan of its own.
    """

    def __init__(self, config: TernGradConfig, comm: Collectives, rank: int | None = None, size: int | None = None,
                 blocking_ok: bool = True, rehearsal: bool = False):
        self.config = config
        self.comm = comm
        self.coder = Coder(config, comm.rank if rank is None else rank, comm.size if size is None else size)
        self.blocking_ok = blocking_ok
        # a rehearsal's pipeline (rehearse) has no plan of its own, and sends each group in one collective
        self.rehearsing = rehearsal
        self.auto = AutoPlan() if config.transport == "auto" and not rehearsal else None  # once measured: what to code
        self.plan = StepPlan.of(self.auto)  # this step's, fixed at the last one's end (next_step)
        self.link = config.link() if config.transport == "auto" else None  # what auto plans for (read once)
        self.rehearsal: Pipeline | None = None  # auto's measured steps: this rank's coding, rehearsed (rehearse)
        self.rehearsed_s = 0.0  # the rehearsals' encode + decode seconds this step
        comm.stats = self.coder.stats  # the waits count into this rank's stats

    @property
    def rank(self) -> int:
        return self.coder.rank

    @property
    def size(self) -> int:
        return self.coder.size

    @property
    def step(self) -> int:
        return self.coder.step

    @property
    def stats(self):
        return self.coder.stats

    def uncoded(self, key: str) -> str | None:
        """The wire ("fp32", "fp16") this step's plan sends the group `key` uncoded in, as one average; None where
        it is coded."""
        return self.plan.uncoded(key)

    def float_wire(self) -> str:
        """What the tensors that are never coded (min_numel, exclude) travel in: the wire of transport="auto"'s
        uncoded groups, so that a step's averages share one dtype, which Horovod fuses into one collective (an
        fp16 plan with them in fp32 took two: docs/transports.md); else fp32."""
        return self.plan.wire

    def next_step(self) -> None:
        if self.auto is not None and not self.auto.decided:  # after the verdict, nothing to measure
            self.auto.step_done(self.rehearsed_s, self.size, self.link, self.blocking_ok)
            self.rehearsed_s = 0.0
            if not (self.measuring() and self.auto.rehearsing):
                self.rehearsal = None  # its error feedback's copies of the gradients go
            self.plan = StepPlan.of(self.auto)
        self.coder.next_step()

    def measuring(self) -> bool:
        """Whether this step is one of transport="auto"'s measured steps, which send every group in fp32 and, but for
        the last (AutoPlan.rehearsing), rehearse its coding (rehearse). Without a shared scaler, whose vectors carry the
        trial's verdict, auto codes every group from the start."""
        return self.auto is not None and self.auto.steps < PLAN_STEP and self.config.share_scaler

    def rehearse(self, key: str, named: list[tuple[str, torch.Tensor]], ready: float | None) -> None:
        """A group of auto's measured steps, coded here as it would travel, before its fp32 average: over
        MirrorCollectives, with the model's transport (the allgather where that has owners' replies, which a
        mirror answers with this rank's, another shard's codes) and error feedback of the rehearsal's own. Its
        codes go nowhere, so what trains is FP32 (coded first steps dip NCF: docs/notes/auto.md, "The measured
        steps"). Auto learns the group's size, when it was ready and what coding it cost."""
        r = self.rehearsal
        if r is None:
            r = self.rehearsal = Pipeline(self.config, MirrorCollectives(self.rank, self.size), rehearsal=True,
                                          blocking_ok=self.blocking_ok)
            r.coder.codec = self.coder.codec
        r.coder.step = self.step
        arrived, cur = time.perf_counter(), r.stats.current
        before = cur.time_encode + cur.time_decode
        g = r.start(key, named)
        r.finish(g)
        self.auto.arrived(key, sum(it.numel for it in g.items), len(g.items),
                          sum(r.coder.scaler_bytes(it) for it in g.items), arrived if ready is None else ready,
                          self.rehearsed_s if ready is None else None)
        self.rehearsed_s += cur.time_encode + cur.time_decode - before

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this rank's TernGrad (hvd_terngrad.checkpoint)."""
        return checkpoint.state_dict(self.coder)

    def load_state_dict(self, state: dict) -> None:
        checkpoint.load_state_dict(self.coder, state)

    # ------------------------------------------------------------------------------------------
    def start(self, key: str, named: list[tuple[str, torch.Tensor]], what: str | None = None,
              send_when_shared: bool = True, ready: float | None = None) -> Group:
        """Prepare a group's tensors and start sharing their scalers; without sharing, start the transport
        (unless send_when_shared is False: then send() does). A group transport="auto" sends uncoded starts
        its average at once. ready: when the group was ready (time.perf_counter()), where that was before
        this call, on another thread (auto measures the window backward leaves)."""
        what = what or f"{named[0][0]!r}" + (f" and {len(named) - 1} more" if len(named) > 1 else "")
        auto = self.auto
        measured = self.measuring()
        wire = "fp32" if measured else self.uncoded(key)
        if wire:
            if measured and auto.rehearsing:
                self.rehearse(key, named, ready)  # before the average: it reads the gradients
            g = Group(key, [self.coder.plain(name, grad) for name, grad in named], what, send_when_shared)
            t = g.transport = UNCODED[wire]
            g.stage, g.handle = Stage.SENDING, t.start(self.comm, t.encode(self.coder, g.items), key)
            if measured and auto.carrying:
                g.carrier = self.comm.max_allreduce_async(torch.tensor(auto.carried(), dtype=torch.float32),
                                                          name=f"terngrad.auto.{key}")
            return g
        arrived, encoded = time.perf_counter(), self.stats.current.time_encode
        items = [self.coder.prepare(name, grad) for name, grad in named]
        g = Group(key, items, what, send_when_shared)
        if auto is not None:
            auto.arrived(key, sum(it.numel for it in items), len(items),
                         sum(self.coder.scaler_bytes(it) for it in items), arrived if ready is None else ready,
                         encoded if ready is None else None)
        if self.config.share_scaler:
            head, blocks = scaler_vectors(items, self.config.block_size)
            if auto is not None and auto.carrying:
                carried = auto.carried()
                g.carries = len(carried)
                head = torch.cat([head, torch.tensor(carried, dtype=torch.float32)])
            g.scaler_handle = (self.comm.max_allreduce_async(head, name=f"terngrad.scalers.{key}"),
                               None if blocks is None else
                               self.comm.max_allreduce_async(blocks, name=f"terngrad.block_scalers.{key}"))
            g.stage = Stage.SCALER
        elif send_when_shared:
            self.send(g)
        return g

    def progress(self, g: Group, block: bool = False) -> bool:
        """Move g on by what its finished collective allows (block: wait for it); whether it moved."""
        if g.stage is Stage.SCALER:
            if not (block or self.scalers_arrived(g)):
                return False
            self.share(g)
            if g.send_when_shared:
                self.send(g)
            return True
        if g.stage is Stage.SENDING:
            return g.transport.advance(self.comm, g.handle, g.what, block)
        return False

    def scalers_arrived(self, g: Group) -> bool:
        """Whether g's scaler Max allreduces are done (share() then waits no more)."""
        return all(h is None or self.comm.poll(h) for h in g.scaler_handle)

    def share(self, g: Group) -> None:
        """Wait for g's scaler Max allreduces (at most timeout_s each) and take the shared scalers."""
        if g.stage is Stage.SCALER:
            head, blocks = g.scaler_handle
            head = self.comm.wait(head, f"the scaler Max allreduce of {g.what}")
            if g.carries:
                head, carried = head[:-g.carries], head[-g.carries:]
                self.auto.agree(carried.cpu().tolist())
            if blocks is not None:
                blocks = self.comm.wait(blocks, f"the block scaler Max allreduce of {g.what}")
            apply_shared(g.items, head, blocks, self.config.block_size, self.coder)
            g.scaler_handle = None
            g.stage = Stage.SHARED

    def send(self, g: Group) -> None:
        """Encode g in its transport's layout and start the transport."""
        if g.stage is Stage.SENDING:  # an uncoded group's average started with it
            return
        self.share(g)
        configured = self.plan.transport or self.config.transport
        t = g.transport = resolve_transport(configured, sum(it.numel for it in g.items), self.size,
                                            int8=self.blocking_ok, link=self.link)
        if self.rehearsing and t.reply_collective:  # a mirror answers other shards' owners with this rank's reply
            t = g.transport = TRANSPORTS["allgather"]
        g.handle = t.start(self.comm, t.encode(self.coder, g.items), g.key)
        g.stage = Stage.SENDING

    def finish(self, g: Group, outs: list[torch.Tensor | None] | None = None,
               decode: bool = True) -> list[torch.Tensor] | None:
        """Wait for g's transport (at most timeout_s a collective) and decode the averages (fp32, flat, into
        `outs` where given). decode=False: only wait (a simulated rank whose decode another rank makes)."""
        if g.stage is not Stage.SENDING:
            self.send(g)
        received = g.transport.finish(self.comm, g.handle, g.what)
        if g.carrier is not None:
            carried = self.comm.wait(g.carrier, f"the measurement of transport='auto' beside {g.what}")
            self.auto.agree(carried.cpu().tolist())
            g.carrier = None
        g.stage = Stage.DONE
        if not decode:
            return None
        averages = g.transport.decode(self.coder, g.items, received, outs=outs)
        if self.config.on_nonfinite == "propagate":  # NaN, as a float average would be: AMP's GradScaler sees it
            for it, avg in zip(g.items, averages):
                if it.nonfinite_rank >= 0:
                    avg.fill_(float("nan"))
        return averages

    def finish_into(self, g: Group, grads: list[torch.Tensor]) -> None:
        """finish(g), the averages written into `grads` (g's tensors, in order) in place: decoded straight into
        the contiguous fp32 ones, converted into the others."""
        direct = [t.view(-1) if t.dtype == torch.float32 and t.is_contiguous() else None for t in grads]
        for t, avg in zip(grads, self.finish(g, outs=direct)):
            if avg.data_ptr() != t.data_ptr():
                t.copy_(avg.view(t.shape))

    def nonfinite(self, g: Group) -> list[Item]:
        """g's tensors that were non-finite on some rank (known on every rank once shared or decoded)."""
        return self.coder.nonfinite(g.items)


def scaler_vectors(items: list[Item], block_size: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per tensor [s, f, t, -t] (fp32) for the Max allreduce, and with block scalers their 16-bit carrier
    (fp16; module docstring)."""
    vals = []
    for it in items:
        t = float(it.tag & 0xFFFFFF)
        vals += [it.scaler, float(it.nonfinite_rank + 1), t, -t]
    head = torch.tensor(vals, dtype=torch.float32)
    return head, (block_scalers_carrier(torch.cat([it.scalers for it in items])) if block_size else None)


def apply_shared(items: list[Item], head: torch.Tensor, blocks: torch.Tensor | None, block_size: int | None,
                 coder: Coder) -> None:
    """The shared scalers and non-finite ranks from the reduced scaler vectors, checked."""
    head = head.cpu()
    nblocks = sum(it.scalers.numel() for it in items) if block_size else 0
    got = 0 if blocks is None else blocks.numel()
    if head.numel() != 4 * len(items) or got != nblocks:
        raise PayloadMismatchError(
            f"hvd_terngrad: scaler vectors of {head.numel()} and {got} values, expected {4 * len(items)} and "
            f"{nblocks} for {len(items)} tensors (rank {coder.rank}, first tensor {items[0].name!r}): ranks "
            f"disagree on tensor groups or block_size")
    vals = head.tolist()
    if blocks is not None:
        shared = block_scalers_from_carrier(blocks.cpu())
        off = 0
        for it in items:
            it.scalers = shared[off: off + it.scalers.numel()].clone()
            off += it.scalers.numel()
    for i, it in enumerate(items):
        if vals[4 * i + 2] != -vals[4 * i + 3]:
            raise PayloadMismatchError(
                f"hvd_terngrad: tensor {it.name!r}: the ranks sent different tensors (name, shape or dtype) "
                f"in the same place (checked on rank {coder.rank} at step {coder.step})")
        it.scaler = vals[4 * i]
        it.nonfinite_rank = int(vals[4 * i + 1]) - 1


def exchange(pipes: list[Pipeline], key: str, named: list[list[tuple[str, torch.Tensor]]],
             decode_ranks: tuple[int, ...] | None = None) -> tuple[list[Group], list[list[torch.Tensor] | None]]:
    """One group through the pipelines of N in-process ranks (loopback collectives), in lockstep: every rank
    starts, all move on until none can, all finish. Returns each rank's group and averages (None where a rank
    is not in decode_ranks: every rank decodes the same bytes, so one decode can serve a simulation)."""
    groups = [p.start(key, nm) for p, nm in zip(pipes, named)]
    while any([p.progress(g) for p, g in zip(pipes, groups)]):  # a list: every rank moves each round
        pass
    return groups, [p.finish(g, decode=decode_ranks is None or r in decode_ranks)
                    for r, (p, g) in enumerate(zip(pipes, groups))]
