"""The ternary codec: one set of operations over three backends that implement one protocol (Backend).

    moments(x)                                -> Moments(mean, std, absmax, nonfinite) of a gradient
    ternarize_pack(x, scaler, key, out=None)  -> uint8 tensor of ceil(n/4) packed 2-bit codes
    decode_mean(codes, scalers, shared, n)    -> fp32 average of the ranks' ternary tensors
and their block-scaler forms (wire format version 2: one scaler per block of block_size elements):
    block_absmax(x, block_size)               -> fp64 max|x| per block
    ternarize_pack_blocks(x, scalers, block_size, key, out=None)
    decode_mean_blocks(codes, scalers, shared, n, block_size)
and the 16-bit wire of an uncoded average (section 9: transports.uncoded), a power of two each way:
    to_half(x, scale, out=None)               -> fp16 tensor of x * scale
    from_half(h, scale, out=None)             -> the largest |h / scale|, and h / scale into out
    to_halves(xs, scales, out), from_halves(h, sizes, scales, outs=None)   a group's, in one call
and the fp32 wire of the DDP hook's own average:
    scale(x, factor)                          -> x *= factor in place, and the largest |x| after
Error feedback is fused into the coding (docs/wire-format.md, section 13): moments(x, residual=r) and
ternarize_pack(..., residual=r, residual_out=r) code x + r without forming it and write the new residual in place.

(The C and CUDA symbols keep their ABI names: tg_stats computes the moments, tg_decode_sum the mean.)

Backends: "cpu" (C++ kernels, csrc/), "cuda" (CuPy RawKernels, terngrad_kernels.cu) and "reference"
(plain torch, the executable spec), one row each in _BACKENDS. "auto" picks cuda for CUDA tensors and cpu
otherwise. All three give the same bytes for the same inputs; docs/wire-format.md is the contract. A Codec
binds the backend and thread count once and checks every argument, so a backend sees flat, contiguous,
checked tensors only; the module-level functions are a Codec made for one call (backend=, nthreads=).
Adding a backend is a module with a class that implements Backend, and a row in _BACKENDS.
"""
from __future__ import annotations

import torch

from hvd_terngrad.codec import cpu, reference
from hvd_terngrad.codec.protocol import Backend, Moments, RngKey
from hvd_terngrad.errors import CorruptPayload
from hvd_terngrad.wire import codes_size, sum_bits, sums_size

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _cuda_backend(nthreads):
    from hvd_terngrad.codec import cuda  # imported lazily: CuPy is optional

    return cuda.CudaBackend(nthreads)


_BACKENDS = {"cpu": cpu.CpuBackend, "cuda": _cuda_backend, "reference": reference.ReferenceBackend}
BACKENDS = ("auto", *_BACKENDS)


def resolve_backend(x: torch.Tensor, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown codec backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        if x.is_cuda:
            return "cuda"
        return "cpu" if cpu.available() else "reference"
    if backend == "cuda" and not x.is_cuda:
        raise ValueError("backend 'cuda' needs a CUDA tensor")
    if backend == "cpu" and x.is_cuda:
        raise ValueError("backend 'cpu' needs a CPU tensor")
    return backend


def _flat(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"TernGrad codes floating-point tensors (fp32, fp64, fp16, bf16), not {x.dtype}")
    return x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)


def check_block_size(block_size: int) -> None:
    """Block sizes are powers of two from 64 (whole SIMD runs and Philox blocks) to 2^30."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 64 <= block_size <= 1 << 30 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [64, 2**30], got {block_size!r}")


def num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def _codes_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The packed codes' destination for flat x: `out`, checked, or a new one."""
    nbytes = codes_size(x.numel())
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous uint8 tensor of {nbytes} bytes on {x.device}")
    return out


def _check_scalers(scalers: torch.Tensor, shape: tuple) -> torch.Tensor:
    if scalers.dtype != torch.float32 or tuple(scalers.shape) != shape:
        raise ValueError(f"block scalers must be fp32 of shape {shape}, got {scalers.dtype} {tuple(scalers.shape)}")
    if scalers.numel():
        lo, hi = torch.aminmax(scalers)
        if not (float(lo) >= 0 and float(hi) < float("inf")):  # NaN fails both
            raise ValueError("block scalers must be finite and >= 0")
    return scalers.contiguous()


def _residual(x: torch.Tensor, r: torch.Tensor | None, what: str) -> torch.Tensor | None:
    """A residual for flat x: same type, size and device, contiguous (viewed flat), or None."""
    if r is None:
        return None
    if r.dtype != x.dtype or r.numel() != x.numel() or r.device != x.device or not r.is_contiguous():
        raise ValueError(f"{what} must be a contiguous {x.dtype} tensor of {x.numel()} elements on {x.device}, "
                         f"got {r.dtype} of {r.numel()} on {r.device}")
    return r.view(-1)


def _decode_out(codes: list[torch.Tensor], n: int, out: torch.Tensor | None) -> torch.Tensor:
    """Checks every rank's packed codes of n elements; the fp32 destination (`out`, checked, or a new one)."""
    nbytes = codes_size(n)
    for r, c in enumerate(codes):
        if c.dtype != torch.uint8 or c.numel() != nbytes or not c.is_contiguous():
            raise ValueError(f"codes of rank {r}: expected {nbytes} contiguous uint8 bytes, got {c.numel()} {c.dtype}")
    if out is None:
        return torch.empty(n, dtype=torch.float32, device=codes[0].device)
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of {n} elements")
    return out


def _feedback(x: torch.Tensor, r: torch.Tensor | None, r_out: torch.Tensor | None):
    if r is not None and r_out is None:
        raise ValueError("a residual to add needs residual_out, where the new residual goes (it may be the same)")
    return _residual(x, r, "residual"), _residual(x, r_out, "residual_out")


def _valid(ok: bool, what: str = "payload holds invalid ternary codes (0b11 or non-zero padding)") -> None:
    if not ok:
        raise CorruptPayload(what)


class Codec:
    """The codec bound once to a backend ("auto": by each tensor's device) and a CPU thread count."""

    __slots__ = ("backend", "nthreads", "_impls")

    def __init__(self, backend: str = "auto", nthreads: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown codec backend {backend!r}; allowed: {', '.join(BACKENDS)}")
        self.backend, self.nthreads = backend, nthreads
        self._impls: dict[str, Backend] = {}

    def impl(self, x: torch.Tensor) -> Backend:
        """The backend for tensors like x (made once per backend)."""
        name = resolve_backend(x, self.backend)
        be = self._impls.get(name)
        if be is None:
            be = self._impls[name] = _BACKENDS[name](self.nthreads)
        return be

    def moments(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Moments:
        """Moments of x, or of x + residual (error feedback; the sum is never formed whole)."""
        x = _flat(x)
        return Moments(*self.impl(x).moments(x, _residual(x, residual, "residual")))

    def moments_blocks(self, x: torch.Tensor, block_size: int,
                       residual: torch.Tensor | None = None) -> tuple[Moments, torch.Tensor]:
        """moments(x) and block_absmax(x, block_size) together: one pass over x on the CPU backend."""
        check_block_size(block_size)
        x = _flat(x)
        st, absmax = self.impl(x).moments_blocks(x, block_size, _residual(x, residual, "residual"))
        return Moments(*st), absmax

    def block_absmax(self, x: torch.Tensor, block_size: int) -> torch.Tensor:
        """max|x| of each block of block_size elements (NaN ignored), fp64 on x's device: exact for any dtype."""
        check_block_size(block_size)
        x = _flat(x)
        return self.impl(x).block_absmax(x, block_size)

    def ternarize_pack(self, x: torch.Tensor, scaler: float, key: RngKey, out: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> torch.Tensor:
        """Stochastic ternary codes of x on the scale `scaler`, packed four to a byte, into `out` if given.

        Error feedback: codes of x + residual, and residual_out (may be residual) = x + residual - scaler * b."""
        x = _flat(x)
        out = _codes_out(x, out)
        if not (scaler >= 0.0) or scaler == float("inf"):
            raise ValueError(f"scaler must be finite and >= 0, got {scaler}")
        r, r_out = _feedback(x, residual, residual_out)
        self.impl(x).ternarize_pack(x, scaler, key, out, r, r_out)
        return out

    def ternarize_pack_blocks(self, x: torch.Tensor, scalers: torch.Tensor, block_size: int, key: RngKey,
                              out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                              residual_out: torch.Tensor | None = None) -> torch.Tensor:
        """ternarize_pack with scalers[i // block_size] for element i (scalers: fp32, one per block)."""
        check_block_size(block_size)
        x = _flat(x)
        scalers = _check_scalers(scalers, (num_blocks(x.numel(), block_size),))
        out = _codes_out(x, out)
        r, r_out = _feedback(x, residual, residual_out)
        self.impl(x).ternarize_pack_blocks(x, scalers, block_size, key, out, r, r_out)
        return out

    def decode_mean(self, codes: list[torch.Tensor], scalers: list[float], shared: bool, n: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Mean over ranks of scaler_r * b_r, as fp32, from each rank's packed codes.

        shared=True: all ranks used scalers[0]; the code sum gets one multiply by scalers[0] / len(codes).
        """
        if not codes:
            raise ValueError("decode_mean needs the codes of at least one rank")
        if len(scalers) != len(codes):
            raise ValueError(f"{len(codes)} code arrays but {len(scalers)} scalers")
        out = _decode_out(codes, n, out)
        _valid(self.impl(codes[0]).decode_mean(codes, scalers, shared, n, out))
        return out

    def decode_mean_blocks(self, codes: list[torch.Tensor], scalers: torch.Tensor, shared: bool, n: int,
                           block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """decode_mean with block scalers: scalers fp32 (nranks, nblocks), or (nblocks,) when shared."""
        check_block_size(block_size)
        if not codes:
            raise ValueError("decode_mean_blocks needs the codes of at least one rank")
        nb = num_blocks(n, block_size)
        scalers = _check_scalers(scalers, (nb,) if shared else (len(codes), nb))
        out = _decode_out(codes, n, out)
        _valid(self.impl(codes[0]).decode_mean_blocks(codes, scalers, shared, n, block_size, out))
        return out

    # The sharded transport's owner step and decode (docs/wire-format.md, section 10).
    def sum_code_shards(self, shards: torch.Tensor, nranks: int) -> torch.Tensor:
        """The owner's step: `shards` holds one row of packed codes per rank (uint8, nranks x S); returns their
        per-element sums packed at wire.sum_bits(nranks) bits (S * bits / 2 bytes). CorruptPayload on 0b11."""
        if shards.dtype != torch.uint8 or shards.dim() != 2 or shards.shape[0] != nranks:
            raise ValueError(f"shards must be uint8 of shape ({nranks}, S), got {tuple(shards.shape)} {shards.dtype}")
        shards = shards.contiguous()
        out = torch.empty(sums_size(shards.shape[1], nranks), dtype=torch.uint8, device=shards.device)
        _valid(self.impl(shards).sum_shards(shards, nranks, out), "a code shard holds the invalid code 0b11")
        return out

    def decode_packed_sums(self, packed: torch.Tensor, nranks: int, start: int, n: int, scaler: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, start + n) of a stream of packed sums, decoded to fp32 means with the shared
        scaler (into `out`: a view of any layout; the kernels write contiguous fp32 ones directly)."""
        if start % 4:
            raise ValueError(f"a tensor's sums start at a multiple of 4 elements (a whole byte of codes), not {start}")
        if ((start + n) * sum_bits(nranks) + 7) // 8 > packed.numel():
            raise ValueError(f"elements [{start}, {start + n}) are beyond the {packed.numel()} bytes of sums")
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=packed.device)
        be = self.impl(packed)
        if not (out.is_contiguous() and out.dtype == torch.float32):
            be = _BACKENDS["reference"](None)
        be.decode_packed_sums(packed.contiguous(), nranks, start, n, scaler, out)
        return out

    def decode_packed_sums_blocks(self, packed: torch.Tensor, nranks: int, start: int, n: int,
                                  scalers: torch.Tensor, block_size: int, first: int = 0,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
        """decode_packed_sums with block scalers: element i is fl32(sum * fl32(s_b / N)), s_b the scaler of the
        tensor's block (first + i) // block_size (first: the tensor element at stream element start)."""
        sums = self.decode_packed_sums(packed, nranks, start, n, float(nranks), out=out)
        return scale_blocks_(sums, scalers / nranks, block_size, start=first)  # sums times fl32(N / N) = 1, exact

    # The 16-bit wire of an uncoded average (docs/wire-format.md, section 9).
    def to_half(self, x: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """x * scale rounded to fp16 (to nearest even), into out (contiguous, of x's size) where given. scale is a
        power of two (transports.uncoded.half_scale), so the rounding is all that is lost. (Called per tensor
        and step: tensors go to the backend as they are, not as flat views, which cost more than a small
        kernel.)"""
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"to_half converts floating-point tensors (fp32, fp64, fp16, bf16), not {x.dtype}")
        x = x if x.is_contiguous() else x.contiguous()
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
        elif out.dtype != torch.float16 or out.numel() != x.numel() or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous fp16 tensor of {x.numel()} elements")
        self.impl(x).to_half(x, scale, out)
        return out

    def from_half(self, h: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  only_finite: bool = False) -> float:
        """The largest |h / scale| (NaN where h holds a NaN), from one read of h; where out is given, also
        h / scale into it (exact: a power of two), and with only_finite only where that largest is finite, so
        that a non-finite average leaves out as it was."""
        if h.dtype != torch.float16 or not h.is_contiguous():
            raise ValueError(f"from_half reads a contiguous fp16 tensor, not {h.dtype}")
        if out is not None and out.numel() != h.numel():
            raise ValueError(f"out has {out.numel()} elements, the average {h.numel()}")
        return self.impl(h).from_half(h, scale, out, only_finite)

    def to_halves(self, xs: list[torch.Tensor], scales: list[float], out: torch.Tensor) -> torch.Tensor:
        """to_half of each x at its scale, back to back in out (contiguous fp16 of their total size, on their
        device): a group's tensors in one call of the backend, where a call a tensor costs more than the pass
        over a small one (measured: docs/notes/tta-log.md, "One collective a step, and grouped fp16 passes")."""
        n, dense = 0, []
        for x in xs:  # one loop: the checks are per tensor, a step's group has many
            if x.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"to_half converts floating-point tensors (fp32, fp64, fp16, bf16), not {x.dtype}")
            if x.device != out.device:
                raise ValueError(f"to_halves: a tensor on {x.device}, out on {out.device}")
            n += x.numel()
            dense.append(x if x.is_contiguous() else x.contiguous())
        if out.dtype != torch.float16 or out.numel() != n or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous fp16 tensor of {n} elements")
        if xs:
            self.impl(out).to_halves(dense, scales, out)
        return out

    def from_halves(self, h: torch.Tensor, sizes: list[int], scales: list[float], outs: list | None = None,
                    only_finite: bool = False) -> list[float]:
        """from_half of each slice of h (sizes back to back) at its scale, into outs[j] where given (an outs[j]
        may be None): the largest |value| of each, in one call of the backend (to_halves)."""
        if h.dtype != torch.float16 or not h.is_contiguous() or h.numel() != sum(sizes):
            raise ValueError(f"from_halves reads a contiguous fp16 tensor of {sum(sizes)} elements, not "
                             f"{h.numel()} of {h.dtype}")
        if outs is not None:
            if len(outs) != len(sizes):
                raise ValueError(f"outs must hold a tensor (or None) for each of the {len(sizes)} sizes")
            for o, n in zip(outs, sizes):
                if o is not None and (o.numel() != n or o.device != h.device):
                    raise ValueError("outs must hold a tensor of each size (or None), on the average's device")
        return self.impl(h).from_halves(h, sizes, scales, outs, only_finite) if sizes else []

    # The fp32 wire of the DDP hook's own average (hvd_terngrad.ddp.averages.OwnAverages).
    def scale(self, x: torch.Tensor, factor: float) -> float:
        """x *= factor in place (factor rounded to fp32, as torch's x.mul_(factor)), and the largest |x| after
        (NaN where x holds a NaN): one pass on the CPU backend, where torch takes two."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"scale works in place on a contiguous fp32 tensor, not {x.dtype}")
        return self.impl(x).scale(x, factor)


def scale_blocks_(values: torch.Tensor, factors: torch.Tensor, block_size: int, start: int = 0) -> torch.Tensor:
    """values[i] *= factors[(start + i) // block_size], in place, one fp32 multiply an element: the block
    form of the shared-scaler decode fl32(sum * fl32(s / N)) once values hold the code sums."""
    f = factors.to(device=values.device, dtype=torch.float32)
    n, i = values.numel(), 0
    head = min(n, (-start) % block_size)
    if head:
        values[:head].mul_(f[start // block_size])
        i = head
    full = (n - i) // block_size
    if full:
        b0 = (start + i) // block_size
        values[i: i + full * block_size].view(full, block_size).mul_(f[b0: b0 + full, None])
        i += full * block_size
    if i < n:
        values[i:].mul_(f[(start + i) // block_size])
    return values


def _unbound(name: str):
    """Codec.<name> as a module-level function that binds a Codec for the call (backend=, nthreads=)."""
    method = getattr(Codec, name)

    def call(*args, backend: str = "auto", nthreads: int | None = None, **kwargs):
        return method(Codec(backend, nthreads), *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


moments = _unbound("moments")
moments_blocks = _unbound("moments_blocks")
block_absmax = _unbound("block_absmax")
ternarize_pack = _unbound("ternarize_pack")
ternarize_pack_blocks = _unbound("ternarize_pack_blocks")
decode_mean = _unbound("decode_mean")
decode_mean_blocks = _unbound("decode_mean_blocks")
sum_code_shards = _unbound("sum_code_shards")
decode_packed_sums = _unbound("decode_packed_sums")
decode_packed_sums_blocks = _unbound("decode_packed_sums_blocks")
to_half = _unbound("to_half")
from_half = _unbound("from_half")
scale = _unbound("scale")
