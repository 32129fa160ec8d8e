"""The per-step TernGrad pipeline, without Horovod: gradient -> policy -> codec -> records -> decode.

Both Horovod front ends (compression.TernGrad for the stock optimizer and optimizer.DistributedOptimizer)
drive one TernGradEngine. It knows the rank and world size but never communicates; the caller moves the
scaler vector (Max allreduce) and the payloads (allgather) with transport.py.

One step on one rank, for a group of tensors:
    items = [engine.prepare(name, grad) ...]       stats, local scaler, residual added
    vec = engine.scaler_vector(items)              -> Max allreduce across ranks   (share_scaler only)
    engine.apply_shared(items, reduced_vec)        shared scaler; a non-finite rank is known everywhere
    payload = engine.encode(items)                 header + packed codes per tensor -> allgather
    engine.decode(items, gathered)                 average of the ranks' ternary tensors, fp32 per item
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hvd_terngrad import codec, wire
from hvd_terngrad.config import TernGradConfig, payload_tag, tensor_id
from hvd_terngrad.stats import StatsRecorder


class TernGradError(RuntimeError):
    """Base class of the errors TernGrad raises on every rank."""


class NonFiniteGradientError(TernGradError):
    """A gradient held NaN or Inf on some rank; raised on every rank in the same step."""


class PayloadMismatchError(TernGradError, wire.PayloadMismatch):
    """Ranks sent records that do not belong together."""


class CollectiveTimeoutError(TernGradError):
    """A collective of TernGrad's did not complete within timeout_s: a peer never joined it."""


@dataclass
class Item:
    """One tensor of one step on this rank."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    flat: torch.Tensor  # contiguous, 1-D, gradient (+ residual)
    tag: int
    tid: int
    scaler: float  # local scaler, then the shared one after apply_shared
    nonfinite_rank: int  # -1 if every rank's tensor is finite (as far as known)
    offset: int = 0  # of its record in this rank's payload
    scalers: torch.Tensor | None = None  # block_size: fp32 (CPU) per block, local then shared; `scaler` is their max

    @property
    def numel(self) -> int:
        return self.flat.numel()


class TernGradEngine:
    def __init__(self, config: TernGradConfig, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside world of size {size}")
        self.config = config
        self.rank = rank
        self.size = size
        self.step = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self.owner_residuals: dict[str, torch.Tensor] = {}  # sharded-ternary: this rank's shard, per group
        self.stats = StatsRecorder()
        self.scalers_used: dict[str, float] = {}  # name -> scaler of its last coding (shared when sharing)
        self._scratch_bufs: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------
    def next_step(self) -> None:
        self.step += 1
        self.stats.finish_step(self.step)

    def key(self, item: Item) -> codec.RngKey:
        return codec.RngKey(self.config.seed, self.step & 0xFFFFFFFF, self.rank, item.tid)

    def check_dtype(self, name: str, grad: torch.Tensor) -> None:
        if grad.dtype not in codec.SUPPORTED_DTYPES:
            raise TypeError(f"hvd_terngrad: gradient of {name!r} on rank {self.rank} has dtype {grad.dtype}; "
                            f"TernGrad codes fp32, fp64, fp16 and bf16 gradients")
        if grad.is_sparse:
            raise TypeError(f"hvd_terngrad: gradient of {name!r} on rank {self.rank} is sparse; "
                            f"TernGrad codes dense gradients (use sparse_as_dense=True or exclude it)")

    def prepare(self, name: str, grad: torch.Tensor) -> Item:
        self.check_dtype(name, grad)
        cfg = self.config
        with self.stats.timed("encode"):
            flat = grad.detach().reshape(-1)
            if cfg.error_feedback and name in self.residuals:
                flat = flat + self.residuals[name]
            elif not flat.is_contiguous():
                flat = flat.contiguous()
            scalers = None
            if cfg.block_size:
                st, absmax = codec.moments_blocks(flat, cfg.block_size, backend=cfg.backend, nthreads=cfg.num_threads)
                scalers = torch.zeros(absmax.numel()) if st.nonfinite else cfg.block_scalers(st, absmax.cpu())
            else:
                st = codec.moments(flat, backend=cfg.backend, nthreads=cfg.num_threads)
            bad = st.nonfinite > 0
        if bad:
            scaler = 0.0
        elif scalers is None:
            scaler = cfg.scaler(st)
        else:  # the tensor's entry in the scaler vector: its largest block scaler
            scaler = float(scalers.max()) if scalers.numel() else 0.0
        return Item(name=name, shape=grad.shape, dtype=grad.dtype, flat=flat,
                    tag=payload_tag(name, grad.shape, grad.dtype), tid=tensor_id(name),
                    scaler=scaler, nonfinite_rank=self.rank if bad else -1, scalers=scalers)

    # ------------------------------------------------------------------------------------------
    def scaler_vector(self, items: list[Item]) -> torch.Tensor:
        """Per tensor [s, f, t, -t] for a Max allreduce: f = rank + 1 where the tensor is non-finite, t the low
        24 bits of its tag (exact in fp32). After the Max, t != -(-t) means the ranks sent different tensors.
        With block scalers, every tensor's block scalers follow, in item order."""
        vals = []
        for it in items:
            t = float(it.tag & 0xFFFFFF)
            vals += [it.scaler, float(it.nonfinite_rank + 1), t, -t]
        head = torch.tensor(vals, dtype=torch.float32)
        return torch.cat([head] + [it.scalers for it in items]) if self.config.block_size else head

    def apply_shared(self, items: list[Item], reduced: torch.Tensor) -> None:
        reduced = reduced.cpu()
        blocks = sum(it.scalers.numel() for it in items) if self.config.block_size else 0
        if reduced.numel() != 4 * len(items) + blocks:
            raise PayloadMismatchError(
                f"hvd_terngrad: scaler vector of {reduced.numel()} values, expected {4 * len(items) + blocks} for "
                f"{len(items)} tensors (rank {self.rank}, first tensor {items[0].name!r}): ranks disagree on tensor "
                f"groups or block_size")
        vals = reduced[: 4 * len(items)].tolist()
        off = 4 * len(items)
        for it in items:
            if it.scalers is not None:
                it.scalers = reduced[off: off + it.scalers.numel()].clone()
                off += it.scalers.numel()
        for i, it in enumerate(items):
            if vals[4 * i + 2] != -vals[4 * i + 3]:
                raise PayloadMismatchError(
                    f"hvd_terngrad: tensor {it.name!r}: the ranks sent different tensors (name, shape or dtype) "
                    f"in the same place (checked on rank {self.rank} at step {self.step})")
            it.scaler = vals[4 * i]
            it.nonfinite_rank = int(vals[4 * i + 1]) - 1

    def nonfinite(self, items: list[Item]) -> list[Item]:
        return [it for it in items if it.nonfinite_rank >= 0]

    def raise_nonfinite(self, items: list[Item]) -> None:
        bad = self.nonfinite(items)
        if bad:
            it = bad[0]
            names = ", ".join(repr(b.name) for b in bad[:5])
            raise NonFiniteGradientError(
                f"hvd_terngrad: non-finite (NaN/Inf) gradient in {it.name!r} on rank {it.nonfinite_rank} at step "
                f"{self.step} (reported on rank {self.rank}; affected: {names}). Every rank raises this in the "
                f"same step; pass on_nonfinite='skip' to hvd_terngrad.DistributedOptimizer to skip such steps.")

    # ------------------------------------------------------------------------------------------
    def record_size(self, it: Item) -> int:
        return wire.record_size(it.numel, self.config.block_size or 0, self.config.share_scaler)

    def payload_size(self, items: list[Item]) -> int:
        return sum(self.record_size(it) for it in items)

    def scaler_bytes(self, it: Item) -> int:
        """What a coded tensor adds to the scaler Max allreduce (share_scaler)."""
        return wire.SCALER_ENTRY_BYTES + (4 * it.scalers.numel() if it.scalers is not None else 0)

    def encode(self, items: list[Item], device: torch.device | None = None) -> torch.Tensor:
        """This rank's payload: one record per item, codes written straight into it."""
        cfg = self.config
        shared, block = cfg.share_scaler, cfg.block_size or 0
        total = self.payload_size(items)
        dev = device or (items[0].flat.device if items else torch.device("cpu"))
        with self.stats.timed("encode"):
            # version 2 pads after the scalers as well as after the codes: zero it all up front
            payload = (torch.zeros if block else torch.empty)(total, dtype=torch.uint8, device=dev)
            off = 0
            for it in items:
                it.offset = off
                self.scalers_used[it.name] = it.scaler
                rec = payload[off: off + self.record_size(it)]
                mine_bad = it.nonfinite_rank == self.rank or (not shared and it.nonfinite_rank >= 0)
                flags = (wire.FLAG_SHARED if shared else 0) | (wire.FLAG_NONFINITE if mine_bad else 0)
                wire.write_header(rec, wire.Header(flags, it.tag, it.numel, 0.0 if block else it.scaler, self.step,
                                                   block))
                start = wire.HEADER_SIZE + self._scalers_bytes(it)
                if start > wire.HEADER_SIZE:  # version 2, scalers not shared: this rank's block scalers
                    rec[wire.HEADER_SIZE: wire.HEADER_SIZE + 4 * it.scalers.numel()].copy_(
                        it.scalers.view(torch.uint8))
                self._code_into(it, rec[start: start + wire.codes_size(it.numel)])
                if not block:
                    wire.zero_padding(rec, it.numel)
                off += self.record_size(it)
        for it in items:
            self.stats.add_coded(self.record_size(it), it.numel * it.flat.element_size(), self.size,
                                 scaler_bytes=self.scaler_bytes(it) if shared else 0)
        return payload

    def _scalers_bytes(self, it: Item) -> int:
        """Bytes of block scalers in it's record: version 2 without a shared scaler only."""
        if not self.config.block_size or self.config.share_scaler:
            return 0
        return wire.block_scalers_size(it.numel, self.config.block_size)

    def codes(self, it: Item, out: torch.Tensor | None = None) -> torch.Tensor:
        """it's packed codes (into out), with its scaler or block scalers."""
        cfg = self.config
        if it.scalers is not None:
            return codec.ternarize_pack_blocks(it.flat, it.scalers, cfg.block_size, self.key(it), out=out,
                                               backend=cfg.backend, nthreads=cfg.num_threads)
        return codec.ternarize_pack(it.flat, it.scaler, self.key(it), out=out, backend=cfg.backend,
                                    nthreads=cfg.num_threads)

    def _code_into(self, it: Item, codes: torch.Tensor) -> None:
        """Write it's packed codes into `codes` (all zero for a non-finite tensor); keep the residual."""
        cfg = self.config
        if it.nonfinite_rank >= 0:
            codes.zero_()
            return
        self.codes(it, out=codes)
        if cfg.error_feedback:
            self._keep_residual(it, codec.decode_mean([codes], [1.0], True, it.numel, backend=cfg.backend,
                                                      nthreads=cfg.num_threads))

    def encode_stream(self, items: list[Item], reply_bytes=None) -> torch.Tensor:
        """The sharded transports' payload (docs/wire-format.md, section 10): the items' packed codes back to
        back (it.offset: its first byte), then zero bytes up to a multiple of N, one shard per rank.
        reply_bytes(shard): what each owner sends back (default: its packed sums), for the traffic count."""
        n = self.size
        dev = items[0].flat.device if items else torch.device("cpu")
        with self.stats.timed("encode"):
            stream = torch.zeros(self.shard_bytes(items) * n, dtype=torch.uint8, device=dev)
            off = 0
            for it in items:
                it.offset = off
                self.scalers_used[it.name] = it.scaler
                self._code_into(it, stream[off: off + wire.codes_size(it.numel)])
                off += wire.codes_size(it.numel)
        shard = stream.numel() // n
        sums = reply_bytes(shard) if reply_bytes else wire.sums_size(shard, n)
        for k, it in enumerate(items):  # the bucket's traffic, counted with its first tensor
            sent, received = ((n - 1) * shard + sums, (n - 1) * (shard + sums)) if k == 0 else (0, 0)
            self.stats.add_coded(sent, it.numel * it.flat.element_size(), n, scaler_bytes=self.scaler_bytes(it),
                                 received=received)
        return stream

    def shard_bytes(self, items: list[Item]) -> int:
        """Bytes of one rank's shard of the items' code stream (section 10)."""
        return (sum(wire.codes_size(it.numel) for it in items) + self.size - 1) // self.size

    def _check_replies(self, items: list[Item], got: torch.Tensor, per_owner: int, what: str) -> None:
        """The allgathered replies of the N owners must be N x per_owner bytes."""
        if got.numel() != self.size * per_owner:
            raise PayloadMismatchError(
                f"hvd_terngrad: received {got.numel()} bytes of {what} for tensors starting with {items[0].name!r}, "
                f"expected {self.size * per_owner} (rank {self.rank}): the ranks disagree on which tensors travel "
                f"together")

    def decode_packed_sums(self, items: list[Item], packed: torch.Tensor,
                           outs: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The averages from every owner's packed sums, allgathered in rank order (section 10)."""
        n = self.size
        with self.stats.timed("decode"):
            self._check_replies(items, packed, wire.sums_size(self.shard_bytes(items), n), "code sums")
            return [self._decode_sums(packed, 4 * it.offset, it, out=outs[i] if outs else None)
                    for i, it in enumerate(items)]

    def _decode_sums(self, packed: torch.Tensor, start: int, it: Item, out: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        if it.scalers is None:
            return codec.decode_packed_sums(packed, self.size, start, it.numel, it.scaler, out=out,
                                            backend=cfg.backend, nthreads=cfg.num_threads)
        return codec.decode_packed_sums_blocks(packed, self.size, start, it.numel, it.scalers, cfg.block_size,
                                               out=out, backend=cfg.backend, nthreads=cfg.num_threads)

    def decode_owner_codes(self, items: list[Item], gathered: torch.Tensor,
                           outs: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The averages from every owner's reply of sharded-ternary (section 11): [fp32 scaler, codes of its
        shard] in rank order; each element is its owner's code times its owner's scaler."""
        n = self.size
        with self.stats.timed("decode"):
            shard = self.shard_bytes(items)
            self._check_replies(items, gathered, wire.OWNER_SCALER_BYTES + shard, "owner codes")
            rows = gathered.view(n, wire.OWNER_SCALER_BYTES + shard)
            scalers = rows[:, :wire.OWNER_SCALER_BYTES].contiguous().view(torch.float32).reshape(-1).tolist()
            codes = rows[:, wire.OWNER_SCALER_BYTES:].reshape(-1)
            return [self._decode_pieces(it, codes, scalers, shard, outs[i] if outs else None)
                    for i, it in enumerate(items)]

    def _decode_pieces(self, it: Item, codes: torch.Tensor, scalers: list[float], shard: int,
                       out: torch.Tensor | None) -> torch.Tensor:
        """One tensor's elements, piece by piece of the owners' shards it spans (shards end on whole bytes)."""
        if out is None:
            out = torch.empty(it.numel, dtype=torch.float32, device=codes.device)
        first, end = 4 * it.offset, 4 * it.offset + it.numel
        for j in range(first // (4 * shard), (end - 1) // (4 * shard) + 1):
            lo, hi = max(first, 4 * shard * j), min(end, 4 * shard * (j + 1))
            piece = codes[lo // 4: (hi + 3) // 4]
            try:
                codec.decode_mean([piece], [scalers[j]], True, hi - lo, out=out[lo - first: hi - first],
                                  backend=self.config.backend, nthreads=self.config.num_threads)
            except codec.CorruptPayload as exc:
                raise PayloadMismatchError(f"hvd_terngrad: tensor {it.name!r}, owner {j}: {exc}") from None
        return out

    def _keep_residual(self, it: Item, b: torch.Tensor) -> None:
        """Error feedback: what this rank's coding of `it` lost, flat - s * b (b: the code values, fp32)."""
        if it.scalers is not None:
            local = codec.scale_blocks_(b.clone(), it.scalers, self.config.block_size)
        else:
            local = b * torch.tensor(it.scaler, dtype=torch.float32, device=b.device)
        self.residuals[it.name] = it.flat - local.to(it.flat.dtype)

    def encode_values(self, items: list[Item], dtype: torch.dtype) -> torch.Tensor:
        """The summed transport's payload: every code as a value in {-1, 0, 1} (fp16 or int8), back to back."""
        cfg = self.config
        with self.stats.timed("encode"):
            total = sum(it.numel for it in items)
            dev = items[0].flat.device if items else torch.device("cpu")
            values = torch.empty(total, dtype=dtype, device=dev)
            off = 0
            for it in items:
                it.offset = off
                self.scalers_used[it.name] = it.scaler
                if it.nonfinite_rank >= 0:
                    values[off: off + it.numel].zero_()
                else:
                    codes = self.codes(it)
                    b = codec.decode_mean([codes], [1.0], True, it.numel, out=self.scratch(it.numel, dev),
                                         backend=cfg.backend, nthreads=cfg.num_threads)
                    values[off: off + it.numel].copy_(b)
                    if cfg.error_feedback:
                        self._keep_residual(it, b)
                off += it.numel
        for it in items:
            self.stats.add_coded(it.numel * values.element_size(), it.numel * it.flat.element_size(), self.size,
                                 scaler_bytes=self.scaler_bytes(it))
        return values

    def scratch(self, n: int, device: torch.device, use: str = "values") -> torch.Tensor:
        """A reused fp32 buffer per use: the values encoder's ±1 codes, or a shard owner's averages, would
        otherwise be a fresh (page-faulting) allocation per tensor and step."""
        buf = self._scratch_bufs.get(use)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = self._scratch_bufs[use] = torch.empty(n, dtype=torch.float32, device=device)
        return buf[:n]

    def decode_sums(self, items: list[Item], summed: torch.Tensor,
                    outs: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The averages from the summed codes: fl32((sum of codes) * fl32(s / N)), as the allgather decode.

        outs: optional destinations (contiguous fp32, one per item, or None), written in place."""
        with self.stats.timed("decode"):
            if summed.numel() != sum(it.numel for it in items):
                raise PayloadMismatchError(
                    f"hvd_terngrad: received {summed.numel()} code sums for tensors starting with {items[0].name!r}, "
                    f"expected {sum(it.numel for it in items)} (rank {self.rank})")
            out = []
            for i, it in enumerate(items):
                dst = outs[i] if outs and outs[i] is not None else torch.empty(it.numel, dtype=torch.float32,
                                                                               device=summed.device)
                dst.copy_(summed[it.offset: it.offset + it.numel])  # exact: integers |v| <= N
                if it.scalers is not None:
                    out.append(codec.scale_blocks_(dst, it.scalers / self.size, self.config.block_size))
                else:
                    out.append(dst.mul_(torch.tensor(it.scaler, dtype=torch.float32, device=summed.device) / self.size))
        return out

    def decode(self, items: list[Item], gathered: torch.Tensor,
               outs: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The averaged gradients (fp32, flat) from the allgathered payloads of all ranks.

        outs: optional destinations (contiguous fp32, one per item, or None): the decode writes there directly.
        """
        cfg = self.config
        with self.stats.timed("decode"):
            per_rank = self.payload_size(items)
            if gathered.numel() != per_rank * self.size:
                self._explain_length(items, gathered, per_rank)
            headers = self._read_headers(items, gathered, per_rank)
            out = []
            for i, it in enumerate(items):
                hs = [headers[r][i] for r in range(self.size)]
                self._check_scalers(it, hs)
                starts = [r * per_rank + it.offset + wire.HEADER_SIZE for r in range(self.size)]
                sb = self._scalers_bytes(it)
                codes = [gathered[s + sb: s + sb + wire.codes_size(it.numel)] for s in starts]
                try:
                    if cfg.block_size:
                        scalers = it.scalers if cfg.share_scaler else self._record_scalers(it, gathered, starts)
                        res = codec.decode_mean_blocks(codes, scalers, cfg.share_scaler, it.numel, cfg.block_size,
                                                       out=outs[i] if outs else None, backend=cfg.backend,
                                                       nthreads=cfg.num_threads)
                    else:
                        res = codec.decode_mean(codes, [h.scaler for h in hs], cfg.share_scaler, it.numel,
                                               out=outs[i] if outs else None, backend=cfg.backend,
                                               nthreads=cfg.num_threads)
                except codec.CorruptPayload as exc:
                    raise PayloadMismatchError(f"hvd_terngrad: tensor {it.name!r} on rank {self.rank}: {exc}") from None
                out.append(res)
        return out

    def _record_scalers(self, it: Item, gathered: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Version 2 without sharing: every rank's block scalers from its record, (N, nblocks) fp32."""
        nb = codec.num_blocks(it.numel, self.config.block_size)
        rows = torch.stack([gathered[s: s + 4 * nb] for s in starts]).cpu().contiguous()
        scalers = rows.view(torch.float32).reshape(self.size, nb)
        ok = (scalers >= 0) & (scalers < float("inf"))  # NaN fails
        if not bool(ok.all()):
            r = int((~ok).any(dim=1).nonzero()[0])
            raise PayloadMismatchError(f"hvd_terngrad: tensor {it.name!r}: the record from rank {r} holds a block "
                                       f"scaler that is negative, NaN or Inf (checked on rank {self.rank})")
        return scalers

    # ------------------------------------------------------------------------------------------
    def _read_headers(self, items: list[Item], gathered: torch.Tensor, per_rank: int) -> list[list[wire.Header]]:
        offs = [r * per_rank + it.offset for r in range(self.size) for it in items]
        idx = (torch.tensor(offs, dtype=torch.int64)[:, None] + torch.arange(wire.HEADER_SIZE)).reshape(-1)
        raw = gathered.index_select(0, idx.to(gathered.device)).cpu().numpy().tobytes()
        headers: list[list[wire.Header]] = []
        k = 0
        for r in range(self.size):
            row = []
            for it in items:
                row.append(self._check(raw[k * wire.HEADER_SIZE:(k + 1) * wire.HEADER_SIZE], it, r))
                k += 1
            headers.append(row)
        return headers

    def _check(self, raw: bytes, it: Item, src: int) -> wire.Header:
        try:
            h = wire.check_header(raw, name=it.name, src_rank=src, my_rank=self.rank, tag=it.tag, numel=it.numel,
                                  step=self.step, block_size=self.config.block_size or 0)
        except wire.PayloadMismatch as exc:
            raise PayloadMismatchError(f"hvd_terngrad: {exc}") from None
        if bool(h.flags & wire.FLAG_SHARED) != self.config.share_scaler:
            raise PayloadMismatchError(
                f"hvd_terngrad: tensor {it.name!r}: rank {src} has share_scaler={bool(h.flags & wire.FLAG_SHARED)} "
                f"but rank {self.rank} has {self.config.share_scaler}: ranks must use the same TernGrad options")
        if h.flags & wire.FLAG_NONFINITE:
            it.nonfinite_rank = src if it.nonfinite_rank < 0 else it.nonfinite_rank
        return h

    def _check_scalers(self, it: Item, hs: list[wire.Header]) -> None:
        if self.config.share_scaler:
            for r, h in enumerate(hs):
                if h.scaler != hs[0].scaler:
                    raise PayloadMismatchError(
                        f"hvd_terngrad: tensor {it.name!r}: rank {r} coded with scaler {h.scaler} but rank 0 with "
                        f"{hs[0].scaler} although the scaler is shared (checked on rank {self.rank})")

    def _explain_length(self, items: list[Item], gathered: torch.Tensor, per_rank: int) -> None:
        """The gathered length is wrong: walk the records to name the rank and tensor, then raise."""
        raw = gathered.cpu().numpy().tobytes()
        off = 0
        for r in range(self.size):
            for it in items:
                if off + wire.HEADER_SIZE > len(raw):
                    break
                magic, _, h = wire.parse_header(raw[off: off + wire.HEADER_SIZE])
                if magic != wire.MAGIC or h.numel != it.numel or h.tag != it.tag or \
                        h.block_size != (self.config.block_size or 0):
                    self._check(raw[off: off + wire.HEADER_SIZE], it, r)
                off += wire.record_size(h.numel, h.block_size, bool(h.flags & wire.FLAG_SHARED))
        raise PayloadMismatchError(
            f"hvd_terngrad: received {gathered.numel()} bytes for {len(items)} tensor(s) starting with "
            f"{items[0].name!r}, expected {per_rank * self.size} ({self.size} ranks x {per_rank}); checked on rank "
            f"{self.rank}: the ranks disagree on which tensors travel together")

