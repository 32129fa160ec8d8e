"""transport="allgather": every rank receives every rank's records (docs/wire-format.md, versions 1 and 2).

A rank's payload is one record a tensor, back to back: a header (name tag, size, step, flags, scaler or block
size), without a shared scaler the rank's block scalers, then the packed 2-bit codes. An item's offset is the
byte of its record in the payload. Each worker moves (N-1) * n/4 bytes, growing with N; the records need no
shared scaler, and they carry what a receiver needs to check that the ranks sent the same tensors.
"""
from __future__ import annotations

import torch

import hvd_terngrad.codec as codec
import hvd_terngrad.wire as wire
from hvd_terngrad.commcost import allgather_bytes, allgather_time
from hvd_terngrad.errors import CorruptPayload, PayloadMismatchError
from hvd_terngrad.transports.base import RECORD_PADDING_BYTES, Transport, destination


class Allgather(Transport):
    name = "allgather"
    needs_shared_scaler = False
    collective = "allgather_u8"

    def encode(self, coder, items):
        """This rank's payload: one record per item, codes written straight into it."""
        cfg = coder.config
        shared, block = cfg.share_scaler, cfg.block_size or 0
        dev = items[0].flat.device if items else torch.device("cpu")
        with coder.stats.timed("encode"):
            # version 2 pads after the scalers as well as after the codes: zero it all up front
            payload = (torch.zeros if block else torch.empty)(payload_size(coder, items), dtype=torch.uint8,
                                                              device=dev)
            off = 0
            for it in items:
                it.offset = off
                rec = payload[off: off + record_size(coder, it)]
                mine_bad = it.nonfinite_rank == coder.rank or (not shared and it.nonfinite_rank >= 0)
                flags = (wire.FLAG_SHARED if shared else 0) | (wire.FLAG_NONFINITE if mine_bad else 0)
                wire.write_header(rec, wire.Header(flags, it.tag, it.numel, 0.0 if block else it.scaler, coder.step,
                                                   block))
                start = wire.HEADER_SIZE + scalers_bytes(coder, it)
                if start > wire.HEADER_SIZE:  # version 2, scalers not shared: this rank's block scalers
                    rec[wire.HEADER_SIZE: wire.HEADER_SIZE + 4 * it.scalers.numel()].copy_(
                        it.scalers.view(torch.uint8))
                coder.code_into(it, rec[start: start + wire.codes_size(it.numel)])
                if not block:
                    wire.zero_padding(rec, it.numel)
                off += record_size(coder, it)
        for it in items:
            coder.stats.add_coded(record_size(coder, it), it.numel * it.flat.element_size(), coder.size,
                                  scaler_bytes=coder.scaler_bytes(it) if shared else 0)
        return payload

    def start(self, comm, payload, key):
        return comm.allgather_async(payload, name=f"terngrad.codes.{key}")

    def decode(self, coder, items, received, outs=None):
        """The averaged gradients (fp32, flat) from the allgathered payloads of all ranks."""
        cfg = coder.config
        with coder.stats.timed("decode"):
            per_rank = payload_size(coder, items)
            if received.numel() != per_rank * coder.size:
                _explain_length(coder, items, received, per_rank)
            headers = _read_headers(coder, items, received, per_rank)
            out = []
            for i, it in enumerate(items):
                hs = [headers[r][i] for r in range(coder.size)]
                _check_scalers(coder, it, hs)
                starts = [r * per_rank + it.offset + wire.HEADER_SIZE for r in range(coder.size)]
                sb = scalers_bytes(coder, it)
                codes = [received[s + sb: s + sb + wire.codes_size(it.numel)] for s in starts]
                try:
                    if cfg.block_size:
                        scalers = it.scalers if cfg.share_scaler else _record_scalers(coder, it, received, starts)
                        res = coder.codec.decode_mean_blocks(codes, scalers, cfg.share_scaler, it.numel,
                                                             cfg.block_size, out=destination(outs, i))
                    else:
                        res = coder.codec.decode_mean(codes, [h.scaler for h in hs], cfg.share_scaler, it.numel,
                                                      out=destination(outs, i))
                except CorruptPayload as exc:
                    raise PayloadMismatchError(f"hvd_terngrad: tensor {it.name!r} on rank {coder.rank}: {exc}") \
                        from None
                out.append(res)
        return out

    def submitted_bytes(self, numel, tensors):
        return wire.codes_size(numel) + wire.HEADER_SIZE * tensors

    def seconds(self, numel, n_workers, link):
        return allgather_time(numel / 4 + wire.HEADER_SIZE, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allgather_bytes(numel / 4 + wire.HEADER_SIZE * tensors + RECORD_PADDING_BYTES * tensors, n_workers)


def record_size(coder, it) -> int:
    return wire.record_size(it.numel, coder.config.block_size or 0, coder.config.share_scaler)


def payload_size(coder, items) -> int:
    return sum(record_size(coder, it) for it in items)


def scalers_bytes(coder, it) -> int:
    """Bytes of block scalers in it's record: version 2 without a shared scaler only."""
    if not coder.config.block_size or coder.config.share_scaler:
        return 0
    return wire.block_scalers_size(it.numel, coder.config.block_size)


def _record_scalers(coder, it, gathered: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """Version 2 without sharing: every rank's block scalers from its record, (N, nblocks) fp32."""
    nb = codec.num_blocks(it.numel, coder.config.block_size)
    rows = torch.stack([gathered[s: s + 4 * nb] for s in starts]).cpu().contiguous()
    scalers = rows.view(torch.float32).reshape(coder.size, nb)
    ok = (scalers >= 0) & (scalers < float("inf"))  # NaN fails
    if not bool(ok.all()):
        r = int((~ok).any(dim=1).nonzero()[0])
        raise PayloadMismatchError(f"hvd_terngrad: tensor {it.name!r}: the record from rank {r} holds a block "
                                   f"scaler that is negative, NaN or Inf (checked on rank {coder.rank})")
    return scalers


def _read_headers(coder, items, gathered: torch.Tensor, per_rank: int) -> list[list[wire.Header]]:
    offs = [r * per_rank + it.offset for r in range(coder.size) for it in items]
    idx = (torch.tensor(offs, dtype=torch.int64)[:, None] + torch.arange(wire.HEADER_SIZE)).reshape(-1)
    raw = gathered.index_select(0, idx.to(gathered.device)).cpu().numpy().tobytes()
    size = wire.HEADER_SIZE
    return [[_check(coder, raw[(r * len(items) + i) * size:(r * len(items) + i + 1) * size], it, r)
             for i, it in enumerate(items)] for r in range(coder.size)]


def _check(coder, raw: bytes, it, src: int) -> wire.Header:
    h = wire.check_header(raw, name=it.name, src_rank=src, my_rank=coder.rank, tag=it.tag, numel=it.numel,
                          step=coder.step, block_size=coder.config.block_size or 0)
    if bool(h.flags & wire.FLAG_SHARED) != coder.config.share_scaler:
        raise PayloadMismatchError(
            f"hvd_terngrad: tensor {it.name!r}: rank {src} has share_scaler={bool(h.flags & wire.FLAG_SHARED)} "
            f"but rank {coder.rank} has {coder.config.share_scaler}: ranks must use the same TernGrad options")
    if h.flags & wire.FLAG_NONFINITE:
        it.nonfinite_rank = src if it.nonfinite_rank < 0 else it.nonfinite_rank
    return h


def _check_scalers(coder, it, hs: list[wire.Header]) -> None:
    if coder.config.share_scaler:
        for r, h in enumerate(hs):
            if h.scaler != hs[0].scaler:
                raise PayloadMismatchError(
                    f"hvd_terngrad: tensor {it.name!r}: rank {r} coded with scaler {h.scaler} but rank 0 with "
                    f"{hs[0].scaler} although the scaler is shared (checked on rank {coder.rank})")


def _explain_length(coder, items, gathered: torch.Tensor, per_rank: int) -> None:
    """The gathered length is wrong: walk the records to name the rank and tensor, then raise."""
    raw = gathered.cpu().numpy().tobytes()
    off = 0
    for r in range(coder.size):
        for it in items:
            if off + wire.HEADER_SIZE > len(raw):
                break
            magic, _, h = wire.parse_header(raw[off: off + wire.HEADER_SIZE])
            if magic != wire.MAGIC or h.numel != it.numel or h.tag != it.tag or \
                    h.block_size != (coder.config.block_size or 0):
                _check(coder, raw[off: off + wire.HEADER_SIZE], it, r)
            off += wire.record_size(h.numel, h.block_size, bool(h.flags & wire.FLAG_SHARED))
    raise PayloadMismatchError(
        f"hvd_terngrad: received {gathered.numel()} bytes for {len(items)} tensor(s) starting with "
        f"{items[0].name!r}, expected {per_rank * coder.size} ({coder.size} ranks x {per_rank}); checked on rank "
        f"{coder.rank}: the ranks disagree on which tensors travel together")
