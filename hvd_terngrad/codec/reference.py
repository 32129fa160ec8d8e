"""Reference codec in plain torch: the executable form of docs/wire-format.md.

Slow and simple on purpose. The C++ and CUDA kernels must produce the same bytes for the same inputs;
the golden vectors in tests/golden/ pin all three.
"""
from __future__ import annotations

import math

import torch

import hvd_terngrad.wire as wire
from hvd_terngrad.finite import absmax

_MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
STAT_BLOCK = 65536
STAT_LANES = 8


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of m * c for uint32 values held in int64, without int64 overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    lo_part = m * c_lo  # < 2^48
    hi_part = m * c_hi  # < 2^48
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _MASK32
    hi = (hi_part + (lo_part >> 16)) >> 16
    return hi, lo


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding uint32 values; returns the four output words."""
    for _ in range(10):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def uniform_halves(n: int, seed: int, step: int, rank: int, tensor_id: int) -> torch.Tensor:
    """The 16-bit random value of each of n elements (int64 tensor).

    Philox block j covers elements 8j .. 8j+7; element i takes the low (i even) or high (i odd) half of
    word (i % 8) // 2.
    """
    nj = (n + 7) // 8
    j = torch.arange(nj, dtype=torch.int64)
    c0 = j & _MASK32
    c1 = ((j >> 32) & 0xFFFF) | (rank << 16)
    c2 = torch.full_like(j, tensor_id & _MASK32)
    c3 = torch.full_like(j, step & _MASK32)
    words = philox4x32_10(c0, c1, c2, c3, seed & _MASK32, (seed >> 32) & _MASK32)
    w = torch.stack(words, dim=1).reshape(-1)
    return torch.stack([w & 0xFFFF, w >> 16], dim=1).reshape(-1)[:n]


def moments(x: torch.Tensor) -> tuple[float, float, float, int]:
    """(mean, std about the mean, max|x|, #non-finite) with the kernels' summation order."""
    x = x.reshape(-1)
    n = x.numel()
    if n == 0:
        return 0.0, 0.0, 0.0, 0
    v = x.double()
    x0 = float(v[0])
    a = v.abs()
    big = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).max
    nonfinite = int((~(a <= big)).sum())
    absmax = float(torch.where(torch.isnan(a), torch.zeros_like(a), a).max())
    d = v - x0
    s = q = 0.0
    for off in range(0, n, STAT_BLOCK):
        blk = d[off:off + STAT_BLOCK]
        pad = (-blk.numel()) % STAT_LANES
        lanes = torch.cat([blk, blk.new_zeros(pad)]).reshape(-1, STAT_LANES)
        ls, lq = [0.0] * STAT_LANES, [0.0] * STAT_LANES
        for row_s, row_q in zip(lanes.tolist(), (lanes * lanes).tolist()):
            for lane in range(STAT_LANES):
                ls[lane] += row_s[lane]
                lq[lane] += row_q[lane]
        bs = bq = 0.0
        for lane in range(STAT_LANES):
            bs += ls[lane]
            bq += lq[lane]
        s += bs
        q += bq
    md = s / n
    var = max(0.0, q / n - md * md)
    return x0 + md, math.sqrt(var), absmax, nonfinite


def codes_of(x: torch.Tensor, scaler, seed: int, step: int, rank: int, tensor_id: int) -> torch.Tensor:
    """Unpacked codes (uint8: 0, 1 = +1, 2 = -1) of a flat tensor; scaler: one float, or fp32 per element."""
    x = x.reshape(-1)
    xf = x.float()
    h = uniform_halves(x.numel(), seed, step, rank, tensor_id)
    # Bernoulli(|x| / s) with the midpoint of a 16-bit cell as the uniform, as fp32 products:
    # keep iff fl((2h + 1) * fl(s * 2^-17)) < |x|.
    s17 = torch.as_tensor(scaler, dtype=torch.float32) * 2.0**-17
    t = (2 * h + 1).float() * s17
    keep = t < xf.abs()
    neg = torch.signbit(xf)
    return torch.where(keep, torch.where(neg, 2, 1), 0).to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Four 2-bit codes a byte, element i at bits 2*(i % 4) of byte i // 4; padding codes are 0."""
    pad = (-codes.numel()) % 4
    c = torch.cat([codes, codes.new_zeros(pad)]).reshape(-1, 4).to(torch.int32)
    return (c[:, 0] | c[:, 1] << 2 | c[:, 2] << 4 | c[:, 3] << 6).to(torch.uint8)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    b = packed.to(torch.int32)
    return torch.stack([(b >> (2 * w)) & 3 for w in range(4)], dim=1).reshape(-1)[:n].to(torch.uint8)


def ternarize_pack(x: torch.Tensor, scaler: float, seed: int, step: int, rank: int, tensor_id: int) -> torch.Tensor:
    return pack(codes_of(x, scaler, seed, step, rank, tensor_id))


def per_element(scalers: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Block scalers (version 2): the value of element i is that of block i // block, for the last dimension."""
    return scalers.repeat_interleave(block, dim=-1)[..., :n]


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """max|x| per block of `block` elements, NaN ignored, in fp64."""
    a = x.reshape(-1).double().abs().nan_to_num(nan=0.0)
    pad = (-a.numel()) % block
    return torch.cat([a, a.new_zeros(pad)]).view(-1, block).max(dim=1).values


def ternarize_pack_blocks(x: torch.Tensor, scalers: torch.Tensor, block: int, seed: int, step: int, rank: int,
                          tensor_id: int) -> torch.Tensor:
    """Version 2: element i coded with scalers[i // block] (fp32)."""
    s = per_element(scalers.float().cpu(), block, x.numel())
    return pack(codes_of(x, s, seed, step, rank, tensor_id))


def decode_mean_blocks(packed: list[torch.Tensor], scalers: torch.Tensor, shared: bool, n: int,
                       block: int) -> tuple[torch.Tensor, bool]:
    """decode_mean with block scalers: scalers (nranks, nblocks), or (nblocks,) when shared."""
    nranks = len(packed)
    w = per_element(scalers.float().cpu().reshape(-1 if shared else nranks, scalers.shape[-1]), block, n) / nranks
    ok = True
    acc = torch.zeros(n, dtype=torch.float32)
    for r, p in enumerate(packed):
        c = unpack(p.cpu(), ((n + 3) // 4) * 4)
        ok = ok and not bool((c == 3).any()) and not bool((c[n:] != 0).any())
        acc = acc + (values(c[:n]) if shared else values(c[:n]) * w[r])
    return (acc * w[0] if shared else acc), ok


# ---------------------------------------------------------------------------------------------
# Error feedback (docs/wire-format.md, section 13): the coded tensor is g + r, summed as torch sums two tensors of
# the gradient's type; the residual is what its coding lost, in that type.
def feedback_input(g: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    return g if r is None else g + r


def feedback_residual(x: torch.Tensor, packed: torch.Tensor, scaler) -> torch.Tensor:
    """x - fl_T(s * b): scaler one float, or fp32 per element."""
    sent = values(unpack(packed.cpu(), x.numel())) * torch.as_tensor(scaler, dtype=torch.float32)
    return x - sent.to(device=x.device, dtype=x.dtype)


def values(codes: torch.Tensor) -> torch.Tensor:
    """Code -> value in {-1, 0, +1} as fp32."""
    return (codes == 1).float() - (codes == 2).float()


def decode_mean(packed: list[torch.Tensor], scalers: list[float], shared: bool, n: int) -> tuple[torch.Tensor, bool]:
    """Average of the ranks' ternary tensors, fp32, with the kernels' rounding; and validity."""
    nranks = len(packed)
    ok = True
    acc = torch.zeros(n, dtype=torch.float32)
    for r, p in enumerate(packed):
        c = unpack(p, ((n + 3) // 4) * 4)
        ok = ok and not bool((c == 3).any()) and not bool((c[n:] != 0).any())
        c = c[:n]
        if shared:
            acc = acc + values(c)
        else:
            w = torch.tensor(scalers[r], dtype=torch.float32) / nranks
            acc = acc + values(c) * w
    if shared:
        acc = acc * (torch.tensor(scalers[0], dtype=torch.float32) / nranks)
    return acc, ok


# ---------------------------------------------------------------------------------------------
# Sharded transport (docs/wire-format.md, section 10): the owner of a shard adds the ranks' codes and
# sends the sums packed at wire.sum_bits(N) bits, offset by N.
def sum_shards(shards: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The per-element sum over ranks (rows of `shards`, uint8 packed codes) as int32; and validity."""
    codes = torch.stack([unpack(row, row.numel() * 4) for row in shards]).to(torch.int32)
    ok = not bool((codes == 3).any())
    return ((codes == 1).to(torch.int32) - (codes == 2).to(torch.int32)).sum(dim=0, dtype=torch.int32), ok


def pack_sums(sums: torch.Tensor, nranks: int) -> torch.Tensor:
    """Sums (an even count) as sum + N in wire.sum_bits(N) bits, little-endian: 4 bits two a byte, low nibble
    first; 8 bits a byte; 16 bits two bytes, low byte first."""
    v = sums.to(torch.int32) + nranks
    bits = wire.sum_bits(nranks)
    if bits == 4:
        return (v[0::2] | v[1::2] << 4).to(torch.uint8)
    if bits == 8:
        return v.to(torch.uint8)
    return torch.stack([v & 0xFF, v >> 8], dim=1).reshape(-1).to(torch.uint8)


def unpack_sums(packed: torch.Tensor, nranks: int) -> torch.Tensor:
    """The inverse of pack_sums: int32 sums."""
    p = packed.to(torch.int32)
    bits = wire.sum_bits(nranks)
    if bits == 4:
        v = torch.stack([p & 15, p >> 4], dim=1).reshape(-1)
    elif bits == 8:
        v = p
    else:
        v = p[0::2] | p[1::2] << 8
    return v - nranks


def decode_sums(sums: torch.Tensor, scaler: float, nranks: int) -> torch.Tensor:
    """fl32(sum * fl32(s / N)): the shared-scaler decode of section 6."""
    return sums.to(torch.float32) * (torch.tensor(scaler, dtype=torch.float32) / nranks)


def to_half(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out = fp16(x * scale) (section 9): the product in fp32 for fp32 and fp16 gradients (exact for a power of
    two), rounded once."""
    torch.mul(x.reshape(out.shape), _factor(scale, x.device) if x.dtype == torch.float16 else scale, out=out)


def scale(x: torch.Tensor, factor: float) -> float:
    """x *= factor in place (fl32 of each product, factor in fp32), and the largest |x| after, NaN where x
    holds one."""
    x.mul_(factor)
    return absmax(x)


def from_half(h: torch.Tensor, scale: float, out: torch.Tensor | None, only_finite: bool) -> float:
    """The largest |h / scale| (NaN where h holds one); h / scale in fp32 (exact) into out where given, with
    only_finite only where that largest is finite."""
    m = absmax(h) / scale  # exact, as the fp32 values are, unless it is past fp32's range, where they are Inf
    m = math.inf if m > _FP32_MAX else m
    if out is not None and (math.isfinite(m) or not only_finite):
        torch.mul(h.reshape(out.shape), _factor(1.0 / scale, h.device), out=out)
    return m


def to_halves(xs: list[torch.Tensor], scales: list[float], out: torch.Tensor, to_half=to_half) -> None:
    """to_half of each x at its scale, back to back in out: a call each (of `to_half`: a backend's own)."""
    off = 0
    for x, scale in zip(xs, scales):
        to_half(x, scale, out[off: off + x.numel()])
        off += x.numel()


def from_halves(h: torch.Tensor, sizes: list[int], scales: list[float], outs: list | None, only_finite: bool,
                from_half=from_half) -> list[float]:
    """from_half of each slice of h (sizes back to back) at its scale, into outs[j] where given: a call each."""
    found, off = [], 0
    for j, (n, scale) in enumerate(zip(sizes, scales)):
        found.append(from_half(h[off: off + n], scale, None if outs is None else outs[j], only_finite))
        off += n
    return found


_FP32_MAX = torch.finfo(torch.float32).max
_FACTORS: dict = {}  # (power of two, device) -> its 1-element fp32 tensor: a step's scales repeat


def _factor(value: float, device) -> torch.Tensor:
    """value as a 1-element fp32 tensor, not a Python number: it makes the product fp32 whatever the other
    factor's dtype (fp16 * number stays fp16, where divided values would leave the normal range)."""
    f = _FACTORS.get((value, device))
    if f is None:
        f = _FACTORS[(value, device)] = torch.tensor([value], dtype=torch.float32, device=device)
    return f


class ReferenceBackend:
    """The executable spec as a codec backend (codec.Backend): plain torch on the CPU, results copied out."""

    name = "reference"

    def __init__(self, nthreads: int | None = None):
        del nthreads  # torch's own

    def moments(self, x, r=None):
        return moments(feedback_input(x, r))

    def moments_blocks(self, x, block, r=None):
        x = feedback_input(x, r)
        return moments(x), block_absmax(x, block).to(x.device)

    def block_absmax(self, x, block):
        return block_absmax(x, block).to(x.device)

    def ternarize_pack(self, x, scaler, key, out, r=None, r_out=None):
        x = feedback_input(x, r)
        out.copy_(ternarize_pack(x, scaler, key.seed, key.step, key.rank, key.tensor_id))
        if r_out is not None:
            r_out.copy_(feedback_residual(x, out, torch.tensor(scaler, dtype=torch.float32)))

    def ternarize_pack_blocks(self, x, scalers, block, key, out, r=None, r_out=None):
        x = feedback_input(x, r)
        out.copy_(ternarize_pack_blocks(x, scalers, block, key.seed, key.step, key.rank, key.tensor_id))
        if r_out is not None:
            r_out.copy_(feedback_residual(x, out, per_element(scalers.float().cpu(), block, x.numel())))

    def decode_mean(self, codes, scalers, shared, n, out):
        res, ok = decode_mean([c.cpu() for c in codes], scalers, shared, n)
        out.copy_(res)
        return ok

    def decode_mean_blocks(self, codes, scalers, shared, n, block, out):
        res, ok = decode_mean_blocks(codes, scalers, shared, n, block)
        out.copy_(res)
        return ok

    def sum_shards(self, shards, nranks, out):
        sums, ok = sum_shards(shards)
        out.copy_(pack_sums(sums, nranks))
        return ok

    def decode_packed_sums(self, packed, nranks, start, n, scaler, out):
        bits = wire.sum_bits(nranks)
        lo, hi = start * bits // 8, ((start + n) * bits + 7) // 8
        out.copy_(decode_sums(unpack_sums(packed[lo:hi], nranks)[: n], scaler, nranks))

    to_half = staticmethod(to_half)
    from_half = staticmethod(from_half)
    to_halves = staticmethod(to_halves)
    from_halves = staticmethod(from_halves)
    scale = staticmethod(scale)
