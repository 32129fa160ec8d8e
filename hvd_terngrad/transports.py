"""TernGrad's transports: how one group of coded tensors travels between ranks, one class each, one table.

A transport is four steps, the way a compressed-communication hook is (GRACE's Communicator, PyTorch's
ddp_comm_hooks):

    payload = t.encode(engine, items)            this rank's codes, in the transport's layout
    handle = t.start(comm, payload, key)         a non-blocking collective (comm: collectives.HorovodCollectives)
    received = t.finish(comm, handle, what)      wait, at most timeout_s
    averages = t.decode(engine, items, received, outs)

plus what the cost model needs: `seconds(numel, n, link)` on a link of commcost's, the calibration's name
for its collective, and the bytes each worker submits. Both optimizers, transport="auto", the performance
model and the benchmarks read TRANSPORTS; adding a transport is a class, a row, and its tests. This module
imports no Horovod: `comm` is handed in.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from hvd_terngrad import codec
from hvd_terngrad.commcost import (
    Link,
    allgather_bytes,
    allgather_time,
    allreduce_bytes,
    allreduce_time,
    alltoall_bytes,
    alltoall_time,
)
from hvd_terngrad.wire import HEADER_SIZE, OWNER_SCALER_BYTES, codes_size, sum_bits, sums_size, tensor_id

# A record's codes are padded to a multiple of 8 bytes: at most 7 a tensor, counted as 8.
RECORD_PADDING_BYTES = 8

# An owner's Philox stream: rank field 32768 + owner, which no worker has (workers are < 32768 ranks).
OWNER_RANK_BASE = 1 << 15


class Transport:
    name = ""
    needs_shared_scaler = True  # codes summed across ranks must share one scale
    stock_ok = True  # its collective can start inside compress() of the stock optimizer
    blocking = False  # start() does nothing; finish() is one blocking call, made in order in synchronize()
    collective = ""  # the calibration's name of its collective (benchmarks/calibrate.py)
    reply_collective = ""  # of its second collective, started by advance(), if it has one
    max_workers = 1 << 30  # beyond this N the sums would not be exact
    # transport="auto" may pick it: its average is the allgather's bit for bit, and its cost model is validated
    # on the emulated clusters (README)
    auto_ok = True

    def encode(self, engine, items) -> torch.Tensor:
        raise NotImplementedError

    def start(self, comm, payload: torch.Tensor, key: str):
        raise NotImplementedError

    def advance(self, comm, handle, what: str, block: bool) -> None:
        """Move a transport of several collectives on to its next one, once the current one is done (block:
        wait for it, at most timeout_s). Called from backward hooks and before synchronize() waits, so that a
        bucket's second collective starts while others still run. Single-collective transports: nothing."""

    def finish(self, comm, handle, what: str) -> torch.Tensor:
        return comm.wait(handle, f"the code {self.name} of {what}")

    def decode(self, engine, items, received: torch.Tensor, outs=None) -> list[torch.Tensor]:
        raise NotImplementedError

    def submitted_bytes(self, numel: int, tensors: int) -> float:
        """Bytes one worker hands its collective for `tensors` tensors of `numel` elements in all."""
        raise NotImplementedError

    def seconds(self, numel: int, n_workers: int, link: Link) -> float:
        """Seconds to exchange one coded tensor of `numel` elements (scaler sharing not included)."""
        raise NotImplementedError

    def wire_bytes(self, numel: int, tensors: int, n_workers: int) -> float:
        """Bytes one worker sends for `tensors` tensors of `numel` coded elements in all, ring algorithms."""
        raise NotImplementedError


class Allgather(Transport):
    """Every rank receives every rank's 2-bit records: (N-1) * n/4 bytes per worker, growing with N."""

    name = "allgather"
    needs_shared_scaler = False
    collective = "allgather_u8"

    def encode(self, engine, items):
        return engine.encode(items, device=items[0].flat.device)

    def start(self, comm, payload, key):
        return comm.allgather_async(payload, name=f"terngrad.codes.{key}")

    def decode(self, engine, items, received, outs=None):
        return engine.decode(items, received, outs=outs)

    def submitted_bytes(self, numel, tensors):
        return codes_size(numel) + HEADER_SIZE * tensors

    def seconds(self, numel, n_workers, link):
        return allgather_time(numel / 4 + HEADER_SIZE, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allgather_bytes(numel / 4 + HEADER_SIZE * tensors + RECORD_PADDING_BYTES * tensors, n_workers)


class Summed(Transport):
    """With a shared scaler the codes are integers on one scale: their sums travel in one fp16 Sum allreduce,
    exact for N <= 2048, about 4n bytes per worker whatever N."""

    name = "summed"
    collective = "allreduce_fp16"
    max_workers = 2048

    def encode(self, engine, items):
        return engine.encode_values(items, torch.float16)

    def start(self, comm, payload, key):
        return comm.sum_async_(payload, name=f"terngrad.sum.{key}")

    def finish(self, comm, handle, what):
        return comm.wait(handle, f"the code-sum allreduce of {what}")

    def decode(self, engine, items, received, outs=None):
        return engine.decode_sums(items, received, outs=outs)

    def submitted_bytes(self, numel, tensors):
        return 2 * numel

    def seconds(self, numel, n_workers, link):
        return allreduce_time(2 * numel, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(2 * numel, n_workers)


class SummedInt8(Summed):
    """The sums as int8 through mpi4py (Horovod's allreduce takes no int8): half the fp16 bytes, N <= 127, the
    hvd_terngrad optimizer only (a blocking MPI call, made in bucket order in synchronize())."""

    name = "summed-int8"
    stock_ok = False
    blocking = True
    collective = "allreduce_int8"
    max_workers = 127

    def encode(self, engine, items):
        return engine.encode_values(items, torch.int8)

    def start(self, comm, payload, key):
        return payload

    def finish(self, comm, handle, what):
        return comm.int8_sum_(handle, what=what)

    def submitted_bytes(self, numel, tensors):
        return numel

    def seconds(self, numel, n_workers, link):
        return allreduce_time(numel, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(numel, n_workers)


class Sharded(Transport):
    """A parameter server spread over all ranks (docs/wire-format.md, section 10): the bucket's 2-bit codes go
    to shard owners in one alltoall, each owner adds the N ranks' codes of its shard and the sums come back in
    one allgather, packed at 4, 8 or 16 bits (N <= 7, 127, 32767). The average is bit-identical to the
    allgather's; each worker moves about (N-1)/N * n/4 * (1 + bits/2) bytes, nearly flat in N."""

    name = "sharded"
    collective = "alltoall_u8"
    reply_collective = "allgather_u8"
    max_workers = 32767

    def encode(self, engine, items):
        return _Plan(engine.encode_stream(items), [], engine.config, engine.step, None)

    def start(self, comm, payload, key):
        return _Flight(comm.alltoall_async(payload.stream, name=f"terngrad.shards.{key}"), payload, key)

    def advance(self, comm, handle, what, block):
        if handle.gather is not None or not (block or comm.poll(handle.alltoall)):
            return
        received = comm.wait(handle.alltoall, f"the code alltoall of {what}")
        if received.numel() != handle.plan.stream.numel():
            raise codec.CorruptPayload(f"received {received.numel()} bytes of code shards for {what}, sent "
                                       f"{handle.plan.stream.numel()}")
        with comm.stats.timed("decode") if comm.stats is not None else nullcontext():  # the owner's codec work
            reply = self.owner_reply(received.view(comm.size, -1), handle.plan, comm.rank, comm.size, handle.key)
        handle.gather = comm.allgather_async(reply, name=f"terngrad.{self.name}.{handle.key}")

    def finish(self, comm, handle, what):
        self.advance(comm, handle, what, block=True)
        return comm.wait(handle.gather, f"the reply allgather of {what}")

    @staticmethod
    def owner_rows(plans: list, owner: int) -> torch.Tensor:
        """What owner `owner` receives from the alltoall, given every rank's payload (in rank order): shard
        `owner` of each rank's stream, one row a rank. (For the simulator and the calibration, which play the
        alltoall in one process.)"""
        return torch.stack([p.stream.view(len(plans), -1)[owner] for p in plans])

    def owner_reply(self, shards, plan, owner, n, key):
        """What owner `owner` sends back for its shard, from every rank's piece of it (`shards`: one row a
        rank, in rank order; `plan`: the owner's own payload): the packed sums."""
        return codec.sum_code_shards(shards, n, backend=plan.config.backend, nthreads=plan.config.num_threads)

    def decode(self, engine, items, received, outs=None):
        return engine.decode_packed_sums(items, received, outs=outs)

    def submitted_bytes(self, numel, tensors):
        return codes_size(numel) + tensors  # the alltoall: each tensor's codes end on a whole byte

    def seconds(self, numel, n_workers, link):
        shard = numel / 4 / n_workers
        return (alltoall_time(numel / 4, n_workers, link)
                + allgather_time(shard * sum_bits(n_workers) / 2, n_workers, link))

    def reply_bytes(self, shard: int, n_workers: int) -> int:
        return sums_size(shard, n_workers)

    def reply_submitted_bytes(self, numel: int, tensors: int, n_workers: int) -> int:
        """Bytes each owner hands the reply allgather for a bucket of `tensors` tensors of `numel` elements."""
        return self.reply_bytes(-(-self.submitted_bytes(numel, tensors) // n_workers), n_workers)

    def wire_bytes(self, numel, tensors, n_workers):
        shard = -(-self.submitted_bytes(numel, tensors) // n_workers)
        return alltoall_bytes(shard * n_workers, n_workers) + allgather_bytes(self.reply_bytes(shard, n_workers),
                                                                              n_workers)


class _Plan:
    """A sharded bucket's payload: the stream of codes, and what an owner of sharded-ternary needs besides the
    codes (where each tensor lies in the stream, its shared scaler, the options and step that key the owner's
    own draw, a scratch buffer for its averages)."""

    __slots__ = ("stream", "segments", "config", "step", "averages", "residuals")

    def __init__(self, stream, segments, config, step, averages, residuals=None):
        self.stream, self.segments, self.config, self.step = stream, segments, config, step
        self.averages = averages  # the owner's fp32 scratch, 4 elements a shard byte
        self.residuals = residuals  # the engine's owner_residuals, with owner_error_feedback


class ShardedTernary(Sharded):
    """The paper's parameter server, spread over all ranks (docs/wire-format.md, section 11): as `sharded`, but
    each owner ternarizes its shard's average again, stochastic and unbiased, with a scaler of its own and a
    Philox stream no worker uses, and replies with 2-bit codes and that scaler. Each worker moves about
    2 (N-1)/N * n/4 bytes, 16x below an FP32 ring at any N; the price is the owner's second draw, whose
    variance adds to the workers'. With clipping on (the default) the owner clips as the workers do."""

    name = "sharded-ternary"
    collective = "alltoall_u8"
    auto_ok = False  # its owners draw again: another average (more variance, clipped with clip > 0), chosen by name

    def encode(self, engine, items):
        stream = engine.encode_stream(items, reply_bytes=lambda shard: self.reply_bytes(shard, engine.size))
        segments = [(4 * it.offset, it.numel, it.scaler, it.scalers) for it in items]
        averages = engine.scratch(4 * stream.numel() // engine.size, stream.device, use="owner")
        return _Plan(stream, segments, engine.config, engine.step, averages, engine.owner_residuals)

    def owner_reply(self, shards, plan, owner, n, key):
        return _ternary_owner_reply(shards, plan, owner, n, key)

    def decode(self, engine, items, received, outs=None):
        return engine.decode_owner_codes(items, received, outs=outs)

    def seconds(self, numel, n_workers, link):
        shard = numel / 4 / n_workers
        return alltoall_time(numel / 4, n_workers, link) + allgather_time(shard + OWNER_SCALER_BYTES, n_workers, link)

    def reply_bytes(self, shard: int, n_workers: int) -> int:
        return shard + OWNER_SCALER_BYTES


class _Flight:
    """A sharded bucket in flight: its alltoall, then (once advanced) the allgather of the owners' replies."""

    __slots__ = ("alltoall", "plan", "key", "gather")

    def __init__(self, alltoall, plan, key):
        self.alltoall, self.plan, self.key, self.gather = alltoall, plan, key, None


def _ternary_owner_reply(shards: torch.Tensor, plan: _Plan, owner: int, n: int, key: str) -> torch.Tensor:
    """Owner `owner`'s reply: [fp32 scaler, 2-bit codes] of its shard's average, drawn again."""
    cfg = plan.config
    shard = shards.shape[1]
    sums = codec.sum_code_shards(shards, n, backend=cfg.backend, nthreads=cfg.num_threads)
    avg = plan.averages.zero_()
    base, spans = 4 * shard * owner, []  # where the shard's tensor elements lie in avg: [lo, hi), merged
    for start, numel, scaler, scalers in plan.segments:  # the shard's pieces of each tensor; padding stays 0
        lo, hi = max(start, base), min(start + numel, base + 4 * shard)
        if lo < hi:
            piece = avg[lo - base: hi - base]
            if scalers is None:
                codec.decode_packed_sums(sums, n, lo - base, hi - lo, scaler, out=piece, backend=cfg.backend,
                                         nthreads=cfg.num_threads)
            else:
                codec.decode_packed_sums_blocks(sums, n, lo - base, hi - lo, scalers, cfg.block_size, first=lo - start,
                                                out=piece, backend=cfg.backend, nthreads=cfg.num_threads)
            if spans and spans[-1][1] == lo - base:
                spans[-1][1] = hi - base
            else:
                spans.append([lo - base, hi - base])
    kept = plan.residuals.get(key) if cfg.owner_error_feedback else None
    if kept is not None and kept.numel() == avg.numel():  # another layout (world size, bucket): start afresh
        avg += kept
    if not spans:
        moments = codec.Moments(0.0, 0.0, 0.0, 0)
    else:  # one span unless a tensor's codes ended inside a byte: then a copy of the pieces, padding left out
        pieces = [avg[lo:hi] for lo, hi in spans]
        moments = codec.moments(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
    scaler = cfg.scaler(moments)
    rng = codec.RngKey(cfg.seed, plan.step & 0xFFFFFFFF, OWNER_RANK_BASE + owner, tensor_id(f"terngrad.owner.{key}"))
    reply = torch.empty(OWNER_SCALER_BYTES + shard, dtype=torch.uint8, device=shards.device)
    reply[:OWNER_SCALER_BYTES] = torch.tensor([scaler], dtype=torch.float32).view(torch.uint8).to(shards.device)
    codes = reply[OWNER_SCALER_BYTES:]
    codec.ternarize_pack(avg, scaler, rng, out=codes, backend=cfg.backend, nthreads=cfg.num_threads)
    if cfg.owner_error_feedback:  # what this draw lost, added to the shard's next average
        sent = codec.decode_mean([codes], [scaler], True, avg.numel(), backend=cfg.backend, nthreads=cfg.num_threads)
        plan.residuals[key] = avg - sent
    return reply


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
