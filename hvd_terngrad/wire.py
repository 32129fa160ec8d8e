"""The on-wire record of one tensor from one rank (docs/wire-format.md, versions 1 and 2).

    offset size field
    0      2    magic b"TG"
    2      1    version (1)
    3      1    flags: bit 0 scaler shared across ranks, bit 1 non-finite input (codes all zero)
    4      4    tag: uint32 LE, CRC-32 of "name|shape|dtype"
    8      8    numel: uint64 LE
    16     4    scaler: float32 LE
    20     4    step: uint32 LE (low 32 bits of the optimizer step)
    24     ...  ceil(numel / 4) bytes of packed 2-bit codes, then zero bytes up to a multiple of 8

Version 2 (block scalers, one per block_size elements) differs in two places: offset 16 holds block_size
(uint32 LE) instead of the scaler, and without a shared scaler the record carries the rank's ceil(numel /
block_size) block scalers (fp32 LE, then zero bytes up to a multiple of 8) between header and codes. With a
shared scaler every rank already holds the block scalers, from the Max allreduce.

A rank's payload is its records back to back; an allgather concatenates the ranks' payloads in rank order.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from hvd_terngrad.errors import PayloadMismatchError as PayloadMismatch

MAGIC = b"TG"
VERSION = 1
VERSION_BLOCKS = 2  # block scalers
VERSIONS = (VERSION, VERSION_BLOCKS)
FLAG_SHARED = 1
FLAG_NONFINITE = 2
HEADER = struct.Struct("<2sBBIQfI")
HEADER_V2 = struct.Struct("<2sBBIQII")  # offset 16: block_size
HEADER_SIZE = HEADER.size  # 24, both versions
# A coded tensor's entry in the scaler Max allreduce (share_scaler=True): [scaler, non-finite rank + 1, tag,
# -tag] as fp32, see pipeline.scaler_vectors.
SCALER_ENTRY_BYTES = 16

# Shared block scalers (section 12) travel at 16 bits in a Max allreduce of their own: each is rounded up to a
# bfloat16 value (so |g| <= s still holds and the codes stay unbiased), and its 16-bit pattern travels as an fp16
# value. Non-negative patterns below 0x7C00 (fp16 Inf) order as the fp16 values with those bits do, so the fp16
# Max is the Max of the scalers; a positive scaler takes at least pattern 0x0400 (2^-119), an fp16-normal one,
# so that no collective's flush-to-zero of subnormals can touch it. Block scalers must be below 2^121 (0x7C00).
BLOCK_SCALER_BYTES = 2
BLOCK_SCALER_LIMIT = 2.0 ** 121
_LEAST_PATTERN = 0x0400


def round_block_scalers(scalers: torch.Tensor) -> torch.Tensor:
    """fp32 block scalers (>= 0, < BLOCK_SCALER_LIMIT) rounded up to bfloat16 values, positive ones to at least
    2^-119: what shared block scalers are (fp32, each exactly a bfloat16 value)."""
    bits = scalers.contiguous().view(torch.int32)
    hi = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    hi = torch.where(bits > 0, hi.clamp(min=_LEAST_PATTERN), hi)
    return (hi << 16).view(torch.float32)


def block_scalers_carrier(rounded: torch.Tensor) -> torch.Tensor:
    """The fp16 values whose bits are the bfloat16 patterns of round_block_scalers' output."""
    return (rounded.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.float16)


def block_scalers_from_carrier(carrier: torch.Tensor) -> torch.Tensor:
    """The fp32 block scalers an fp16 carrier (after the Max) holds."""
    return (carrier.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def codes_size(numel: int) -> int:
    return (numel + 3) // 4


def sum_bits(nranks: int) -> int:
    """Bits of one packed code sum in the sharded transport: the offset sum + N lies in [0, 2N]."""
    for bits in (4, 8, 16):
        if 2 * nranks < 1 << bits:
            return bits
    raise ValueError(f"code sums of {nranks} ranks do not fit 16 bits (at most 32767 ranks)")


def sums_size(shard_bytes: int, nranks: int) -> int:
    """Bytes of one owner's packed sums: its shard holds 4 codes a byte, each sum takes sum_bits(N)."""
    return shard_bytes * sum_bits(nranks) // 2


# sharded-ternary: each owner's reply starts with its shard's scaler, fp32 little-endian (section 11).
OWNER_SCALER_BYTES = 4


def _pad8(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def block_scalers_size(numel: int, block_size: int) -> int:
    """Bytes of a version-2 record's block scalers, padding included."""
    return _pad8(4 * ((numel + block_size - 1) // block_size))


def record_size(numel: int, block_size: int = 0, shared: bool = True) -> int:
    """Bytes of one record: version 1 (block_size 0), or version 2, which carries its block scalers unless
    they are shared."""
    scalers = block_scalers_size(numel, block_size) if block_size and not shared else 0
    return HEADER_SIZE + scalers + _pad8(codes_size(numel))


@dataclass(frozen=True)
class Header:
    flags: int
    tag: int
    numel: int
    scaler: float  # version 1; 0.0 in version 2, whose scalers are per block
    step: int
    block_size: int = 0  # version 2 when > 0

    @property
    def version(self) -> int:
        return VERSION_BLOCKS if self.block_size else VERSION

    def pack(self) -> bytes:
        if self.block_size:
            return HEADER_V2.pack(MAGIC, VERSION_BLOCKS, self.flags, self.tag, self.numel, self.block_size,
                                  self.step & 0xFFFFFFFF)
        return HEADER.pack(MAGIC, VERSION, self.flags, self.tag, self.numel, self.scaler, self.step & 0xFFFFFFFF)


def write_header(record: torch.Tensor, header: Header) -> None:
    """Write header bytes into the first HEADER_SIZE bytes of a uint8 record view."""
    raw = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    record[:HEADER_SIZE].copy_(raw, non_blocking=False)


def zero_padding(record: torch.Tensor, numel: int) -> None:
    start = HEADER_SIZE + codes_size(numel)
    if start < record.numel():
        record[start:].zero_()


def parse_header(raw: bytes) -> tuple[bytes, int, Header]:
    if raw[2:3] == bytes([VERSION_BLOCKS]):
        magic, version, flags, tag, numel, block_size, step = HEADER_V2.unpack(raw)
        return magic, version, Header(flags, tag, numel, 0.0, step, block_size)
    magic, version, flags, tag, numel, scaler, step = HEADER.unpack(raw)
    return magic, version, Header(flags, tag, numel, scaler, step)


def check_header(raw: bytes, *, name: str, src_rank: int, my_rank: int, tag: int, numel: int, step: int,
                 block_size: int = 0) -> Header:
    """Validate one received header against what this rank expects; raise PayloadMismatch otherwise."""
    magic, version, h = parse_header(raw)
    where = f"hvd_terngrad: tensor {name!r}: the record from rank {src_rank} (checked on rank {my_rank})"
    if magic != MAGIC:
        raise PayloadMismatch(f"{where} has no TernGrad magic ({magic!r}): corrupt payload or a rank not "
                              f"running TernGrad")
    if version not in VERSIONS:
        raise PayloadMismatch(f"{where} has wire-format version {version}, this rank speaks {VERSIONS}")
    if h.block_size != block_size:
        raise PayloadMismatch(f"{where} has block_size={h.block_size or None} but rank {my_rank} has "
                              f"{block_size or None}: ranks must use the same TernGrad options")
    if h.numel != numel or h.tag != tag:
        raise PayloadMismatch(f"{where} is another tensor (numel {h.numel}, tag {h.tag:#010x}; expected numel "
                              f"{numel}, tag {tag:#010x}): the ranks disagree on tensor order, names or shapes")
    if h.step != step & 0xFFFFFFFF:
        raise PayloadMismatch(f"{where} is from step {h.step}, this rank is at step {step & 0xFFFFFFFF}: "
                              f"ranks are out of step")
    return h


def tensor_id(name: str) -> int:
    """32-bit id of a tensor name: part of its RNG key and of the payload tag."""
    return zlib.crc32(name.encode("utf-8"))


def payload_tag(name: str, shape, dtype) -> int:
    """32-bit tag a rank's record carries so the receiver can tell it is the tensor it expects."""
    return zlib.crc32(f"{name}|{tuple(shape)}|{dtype}".encode())
