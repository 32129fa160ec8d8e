"""transport="sharded" and "sharded-ternary": a parameter server spread over all ranks (docs/wire-format.md,
sections 10 and 11).

A group's payload is its items' packed codes back to back (an item's offset: its first byte), zero-padded to
N equal shards. One alltoall sends shard j of every rank to owner j; each owner replies to all in one
allgather:
- sharded: the per-element sums of the N ranks' codes, packed at 4, 8 or 16 bits (N <= 7, 127, 32767). The
  average is bit-identical to the allgather's; each worker moves about (N-1)/N * n/4 * (1 + bits/2) bytes.
- sharded-ternary: the owner ternarizes its shard's average again, stochastic and unbiased, with a scaler of
  its own and a Philox stream no worker uses, and replies [fp32 scaler, 2-bit codes]. Each worker moves
  about 2 (N-1)/N * n/4 bytes, 16x below an FP32 ring at any N; the price is the owner's second draw.
"""
from __future__ import annotations

import torch

import hvd_terngrad.codec as codec
import hvd_terngrad.wire as wire
from hvd_terngrad.commcost import allgather_bytes, allgather_time, alltoall_bytes, alltoall_time
from hvd_terngrad.errors import CorruptPayload, PayloadMismatchError
from hvd_terngrad.transports.base import Transport, destination

# An owner's Philox stream: rank field 32768 + owner, which no worker has (workers are < 32768 ranks).
OWNER_RANK_BASE = 1 << 15


class Sharded(Transport):
    name = "sharded"
    collective = "alltoall_u8"
    reply_collective = "allgather_u8"
    max_workers = 32767

    def encode(self, coder, items):
        """The items' packed codes back to back, then zero bytes up to a multiple of N, one shard per rank."""
        n = coder.size
        dev = items[0].flat.device if items else torch.device("cpu")
        with coder.stats.timed("encode"):
            stream = torch.zeros(shard_bytes(coder, items) * n, dtype=torch.uint8, device=dev)
            off = 0
            for it in items:
                it.offset = off
                coder.code_into(it, stream[off: off + wire.codes_size(it.numel)])
                off += wire.codes_size(it.numel)
        shard = stream.numel() // n
        reply = self.reply_bytes(shard, n)
        for k, it in enumerate(items):  # the bucket's traffic, counted with its first tensor
            sent, received = ((n - 1) * shard + reply, (n - 1) * (shard + reply)) if k == 0 else (0, 0)
            coder.stats.add_coded(sent, it.numel * it.flat.element_size(), n, scaler_bytes=coder.scaler_bytes(it),
                                  received=received)
        return _Plan(stream, items, coder)

    def start(self, comm, payload, key):
        return _Flight(comm.alltoall_async(payload.stream, name=f"terngrad.shards.{key}"), payload, key)

    def advance(self, comm, handle, what, block):
        if handle.gather is not None or not (block or comm.poll(handle.alltoall)):
            return False
        received = comm.wait(handle.alltoall, f"the code alltoall of {what}")
        plan = handle.plan
        if received.numel() != plan.stream.numel():
            raise PayloadMismatchError(f"hvd_terngrad: received {received.numel()} bytes of code shards for {what}, "
                                       f"sent {plan.stream.numel()} (rank {plan.coder.rank}): the ranks disagree on "
                                       f"which tensors travel together")
        with plan.coder.stats.timed("decode"):  # the owner's codec work
            try:
                reply = self.owner_reply(received.view(comm.size, -1), plan, handle.key)
            except CorruptPayload as exc:
                raise PayloadMismatchError(f"hvd_terngrad: the code shards of {what} on rank {plan.coder.rank}: "
                                           f"{exc}") from None
        handle.gather = comm.allgather_async(reply, name=f"terngrad.{self.name}.{handle.key}")
        return True

    def finish(self, comm, handle, what):
        self.advance(comm, handle, what, block=True)
        return comm.wait(handle.gather, f"the reply allgather of {what}")

    def owner_reply(self, shards: torch.Tensor, plan: _Plan, key: str) -> torch.Tensor:
        """What this rank, as the owner of its shard, sends back, from every rank's piece of it (`shards`: one
        row a rank, in rank order): the packed sums."""
        return plan.coder.codec.sum_code_shards(shards, plan.coder.size)

    def decode(self, coder, items, received, outs=None):
        """The averages from every owner's packed sums, allgathered in rank order."""
        n = coder.size
        cfg = coder.config
        with coder.stats.timed("decode"):
            _check_replies(coder, items, received, wire.sums_size(shard_bytes(coder, items), n), "code sums")
            out = []
            for i, it in enumerate(items):
                start = 4 * it.offset
                if it.scalers is None:
                    out.append(coder.codec.decode_packed_sums(received, n, start, it.numel, it.scaler,
                                                              out=destination(outs, i)))
                else:
                    out.append(coder.codec.decode_packed_sums_blocks(received, n, start, it.numel, it.scalers,
                                                                     cfg.block_size, out=destination(outs, i)))
            return out

    def submitted_bytes(self, numel, tensors):
        return wire.codes_size(numel) + tensors  # the alltoall: each tensor's codes end on a whole byte

    def seconds(self, numel, n_workers, link):
        shard = numel / 4 / n_workers
        return (alltoall_time(numel / 4, n_workers, link)
                + allgather_time(shard * wire.sum_bits(n_workers) / 2, n_workers, link))

    def reply_bytes(self, shard: int, n_workers: int) -> int:
        return wire.sums_size(shard, n_workers)

    def reply_submitted_bytes(self, numel: int, tensors: int, n_workers: int) -> int:
        """Bytes each owner hands the reply allgather for a bucket of `tensors` tensors of `numel` elements."""
        return self.reply_bytes(-(-self.submitted_bytes(numel, tensors) // n_workers), n_workers)

    def wire_bytes(self, numel, tensors, n_workers):
        shard = -(-self.submitted_bytes(numel, tensors) // n_workers)
        return alltoall_bytes(shard * n_workers, n_workers) + allgather_bytes(self.reply_bytes(shard, n_workers),
                                                                              n_workers)


class ShardedTernary(Sharded):
    name = "sharded-ternary"
    collective = "alltoall_u8"
    auto_ok = False  # its owners draw again: another average (more variance, clipped at owner_clip), chosen by name

    def owner_reply(self, shards, plan, key):
        """[fp32 scaler, 2-bit codes] of this owner's shard average, drawn again, clipped at owner_clip."""
        coder, n = plan.coder, plan.coder.size
        cfg, owner, shard = coder.config, coder.rank, shards.shape[1]
        avg = coder.scratch(4 * shard, shards.device, use="owner").zero_()
        spans = _owner_average(coder.codec.sum_code_shards(shards, n), plan, owner, shard, avg)
        if cfg.owner_error_feedback:
            coder.feedback.add_owner(key, avg)
        if not spans:
            moments = codec.Moments(0.0, 0.0, 0.0, 0)
        else:  # one span unless a tensor's codes ended inside a byte: then a copy of the pieces, padding left out
            pieces = [avg[lo:hi] for lo, hi in spans]
            moments = codec.moments(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        scaler = cfg.owner_scaler(moments)
        rng = codec.RngKey(cfg.seed, coder.step & 0xFFFFFFFF, OWNER_RANK_BASE + owner,
                           wire.tensor_id(f"terngrad.owner.{key}"))
        reply = torch.empty(wire.OWNER_SCALER_BYTES + shard, dtype=torch.uint8, device=shards.device)
        reply[:wire.OWNER_SCALER_BYTES] = torch.tensor([scaler], dtype=torch.float32).view(torch.uint8).to(
            shards.device)
        codes = reply[wire.OWNER_SCALER_BYTES:]
        # with owner error feedback the kernel also writes what this draw lost, added to the shard's next average
        kept = coder.feedback.owner_out(key, avg) if cfg.owner_error_feedback else None
        coder.codec.ternarize_pack(avg, scaler, rng, out=codes, residual_out=kept)
        return reply

    def decode(self, coder, items, received, outs=None):
        """The averages from every owner's reply, in rank order: each element is its owner's code times its
        owner's scaler."""
        n = coder.size
        with coder.stats.timed("decode"):
            shard = shard_bytes(coder, items)
            _check_replies(coder, items, received, wire.OWNER_SCALER_BYTES + shard, "owner codes")
            rows = received.view(n, wire.OWNER_SCALER_BYTES + shard)
            scalers = rows[:, :wire.OWNER_SCALER_BYTES].contiguous().view(torch.float32).reshape(-1).tolist()
            codes = rows[:, wire.OWNER_SCALER_BYTES:].reshape(-1)
            return [_decode_pieces(coder, it, codes, scalers, shard, destination(outs, i))
                    for i, it in enumerate(items)]

    def seconds(self, numel, n_workers, link):
        shard = numel / 4 / n_workers
        return (alltoall_time(numel / 4, n_workers, link)
                + allgather_time(shard + wire.OWNER_SCALER_BYTES, n_workers, link))

    def reply_bytes(self, shard: int, n_workers: int) -> int:
        return shard + wire.OWNER_SCALER_BYTES


class _Plan:
    """A sharded group's payload: the stream of codes, and what its owner needs besides (the items, for where
    each tensor lies in the stream and its shared scaler; the coder, for the options, step and residuals)."""

    __slots__ = ("stream", "items", "coder")

    def __init__(self, stream: torch.Tensor, items: list, coder):
        self.stream, self.items, self.coder = stream, items, coder


class _Flight:
    """A sharded group in flight: its alltoall, then (once advanced) the allgather of the owners' replies."""

    __slots__ = ("alltoall", "plan", "key", "gather")

    def __init__(self, alltoall, plan: _Plan, key: str):
        self.alltoall, self.plan, self.key, self.gather = alltoall, plan, key, None


def shard_bytes(coder, items) -> int:
    """Bytes of one rank's shard of the items' code stream."""
    return (sum(wire.codes_size(it.numel) for it in items) + coder.size - 1) // coder.size


def _owner_average(sums: torch.Tensor, plan: _Plan, owner: int, shard: int, avg: torch.Tensor) -> list[list[int]]:
    """The decoded average of the owner's shard into `avg` (padding stays 0); the spans [lo, hi) of avg that hold
    tensor elements, merged where adjacent."""
    coder, n = plan.coder, plan.coder.size
    base, spans = 4 * shard * owner, []
    for it in plan.items:  # the shard's pieces of each tensor
        start = 4 * it.offset
        lo, hi = max(start, base), min(start + it.numel, base + 4 * shard)
        if lo >= hi:
            continue
        piece = avg[lo - base: hi - base]
        if it.scalers is None:
            coder.codec.decode_packed_sums(sums, n, lo - base, hi - lo, it.scaler, out=piece)
        else:
            coder.codec.decode_packed_sums_blocks(sums, n, lo - base, hi - lo, it.scalers, coder.config.block_size,
                                                  first=lo - start, out=piece)
        if spans and spans[-1][1] == lo - base:
            spans[-1][1] = hi - base
        else:
            spans.append([lo - base, hi - base])
    return spans


def _check_replies(coder, items, got: torch.Tensor, per_owner: int, what: str) -> None:
    """The allgathered replies of the N owners must be N x per_owner bytes."""
    if got.numel() != coder.size * per_owner:
        raise PayloadMismatchError(
            f"hvd_terngrad: received {got.numel()} bytes of {what} for tensors starting with {items[0].name!r}, "
            f"expected {coder.size * per_owner} (rank {coder.rank}): the ranks disagree on which tensors travel "
            f"together")


def _decode_pieces(coder, it, codes: torch.Tensor, scalers: list[float], shard: int,
                   out: torch.Tensor | None) -> torch.Tensor:
    """One tensor's elements, piece by piece of the owners' shards it spans (shards end on whole bytes)."""
    if out is None:
        out = torch.empty(it.numel, dtype=torch.float32, device=codes.device)
    first, end = 4 * it.offset, 4 * it.offset + it.numel
    for j in range(first // (4 * shard), (end - 1) // (4 * shard) + 1):
        lo, hi = max(first, 4 * shard * j), min(end, 4 * shard * (j + 1))
        piece = codes[lo // 4: (hi + 3) // 4]
        try:
            coder.codec.decode_mean([piece], [scalers[j]], True, hi - lo, out=out[lo - first: hi - first])
        except CorruptPayload as exc:
            raise PayloadMismatchError(f"hvd_terngrad: tensor {it.name!r}, owner {j}: {exc}") from None
    return out
