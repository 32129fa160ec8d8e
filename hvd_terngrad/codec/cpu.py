"""CPU backend: ctypes binding to the C++ kernels in csrc/ (built by setup.py as _terngrad_cpu).

The library is found beside this package under the extension-module suffix setuptools gives it and
loaded as a plain shared object. Tensors cross as data pointers; callers hand in contiguous CPU tensors.
"""
from __future__ import annotations

import array
import ctypes
import importlib.machinery
import os
from pathlib import Path

import torch

from hvd_terngrad.codec import reference

_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
ABI_VERSION = 7

_lib = None
_error: str | None = None


def _find_library() -> Path | None:
    pkg = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        cand = pkg / f"_terngrad_cpu{suffix}"
        if cand.exists():
            return cand
    return None


def _load():
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    path = _find_library()
    if path is None:
        _error = "the C++ library _terngrad_cpu is not built (run scripts/install.sh or pip install .)"
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _error = f"cannot load {path}: {exc}"
        return None
    i64, u32, u64, vp = ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.tg_abi_version.restype = ctypes.c_int
    lib.tg_simd_level.restype = ctypes.c_int
    lib.tg_set_simd_level.argtypes = [ctypes.c_int]
    lib.tg_set_simd_level.restype = ctypes.c_int
    lib.tg_decode_sum.argtypes = [ctypes.c_int, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_float), ctypes.c_int,
                                  i64, vp, ctypes.c_int]
    lib.tg_decode_sum.restype = ctypes.c_int
    lib.tg_decode_sum_blocks.argtypes = [ctypes.c_int, ctypes.POINTER(vp), vp, ctypes.c_int, i64, i64, vp,
                                         ctypes.c_int]
    lib.tg_decode_sum_blocks.restype = ctypes.c_int
    lib.tg_block_absmax.argtypes = [ctypes.c_int, vp, i64, i64, vp, ctypes.c_int]
    lib.tg_block_absmax.restype = ctypes.c_int
    lib.tg_ternarize_pack_feedback.argtypes = [ctypes.c_int, vp, vp, i64, vp, i64, u64, u32, u32, u32, vp, vp,
                                               ctypes.c_int]
    lib.tg_ternarize_pack_feedback.restype = ctypes.c_int
    lib.tg_stats_feedback.argtypes = [ctypes.c_int, vp, vp, i64, i64, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                                      vp]
    lib.tg_stats_feedback.restype = ctypes.c_int
    lib.tg_sum_shards.argtypes = [ctypes.c_int, ctypes.POINTER(vp), i64, vp, ctypes.c_int]
    lib.tg_sum_shards.restype = ctypes.c_int
    lib.tg_decode_packed_sums.argtypes = [vp, ctypes.c_int, i64, i64, ctypes.c_float, vp, ctypes.c_int]
    lib.tg_decode_packed_sums.restype = ctypes.c_int
    lib.tg_to_half.argtypes = [vp, i64, ctypes.c_float, vp, ctypes.c_int]
    lib.tg_to_half.restype = ctypes.c_int
    lib.tg_from_half.argtypes = [vp, i64, ctypes.c_float, vp, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                                 ctypes.c_int]
    lib.tg_from_half.restype = ctypes.c_int
    lib.tg_scale.argtypes = [vp, i64, ctypes.c_float, ctypes.POINTER(ctypes.c_double), ctypes.c_int]
    lib.tg_scale.restype = ctypes.c_int
    lib.tg_to_half_group.argtypes = [ctypes.c_int, vp, vp, vp, vp, ctypes.c_int]
    lib.tg_to_half_group.restype = ctypes.c_int
    lib.tg_from_half_group.argtypes = [ctypes.c_int, vp, vp, vp, vp, ctypes.c_int, vp, ctypes.c_int]
    lib.tg_from_half_group.restype = ctypes.c_int
    lib.tg_philox4x32_10.argtypes = [ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.POINTER(u32)]
    lib.tg_philox4x32_10.restype = None
    if lib.tg_abi_version() != ABI_VERSION:
        _error = f"{path} has ABI {lib.tg_abi_version()}, expected {ABI_VERSION}: rebuild it"
        return None
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


def load_error() -> str | None:
    _load()
    return _error


def _lib_or_raise():
    lib = _load()
    if lib is None:
        raise RuntimeError(f"hvd_terngrad CPU backend unavailable: {_error}")
    return lib


def default_threads() -> int:
    env = os.environ.get("HVD_TERNGRAD_THREADS")
    return int(env) if env else torch.get_num_threads()


SIMD_LEVELS = {0: "scalar", 2: "avx2", 3: "avx512"}


def simd_level() -> int:
    """SIMD path in use: 0 scalar, 2 AVX2, 3 AVX-512."""
    return _lib_or_raise().tg_simd_level()


def set_simd_level(max_level: int) -> int:
    """Cap the SIMD path (tests check every path against the reference); returns the level in use."""
    return _lib_or_raise().tg_set_simd_level(max_level)


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise RuntimeError(f"hvd_terngrad C++ kernel {what} rejected its arguments (code {rc})")


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def moments(x: torch.Tensor, nthreads: int | None = None,
            r: torch.Tensor | None = None) -> tuple[float, float, float, int]:
    """Moments of x, or of x + r (error feedback) without forming the sum."""
    lib = _lib_or_raise()
    out = (ctypes.c_double * 4)()
    _check(lib.tg_stats_feedback(_DTYPES[x.dtype], x.data_ptr(), _ptr(r), x.numel(), 0, nthreads or default_threads(),
                                 out, None), "moments")
    return out[0], out[1], out[2], int(out[3])


def ternarize_pack(x: torch.Tensor, scaler: float, seed: int, step: int, rank: int, tensor_id: int,
                   out: torch.Tensor, nthreads: int | None = None, r: torch.Tensor | None = None,
                   r_out: torch.Tensor | None = None) -> None:
    """Codes of x (or of x + r); with r_out, the residual x (+ r) - s*b too (r_out may be r)."""
    s = ctypes.c_float(scaler)
    _ternarize(x, ctypes.addressof(s), 0, (seed, step, rank, tensor_id), out, nthreads, r, r_out, "ternarize_pack")


def _ternarize(x, scalers_ptr, block, key, out, nthreads, r, r_out, what):
    lib = _lib_or_raise()
    rc = lib.tg_ternarize_pack_feedback(_DTYPES[x.dtype], x.data_ptr(), _ptr(r), x.numel(), scalers_ptr, block, *key,
                                        out.data_ptr(), _ptr(r_out), nthreads or default_threads())
    _check(rc, what)


def decode_mean(codes: list[torch.Tensor], scalers: list[float], shared: bool, n: int, out: torch.Tensor,
               nthreads: int | None = None) -> bool:
    """Returns False when a code is invalid (0b11) or a padding code is not zero."""
    lib = _lib_or_raise()
    nr = len(codes)
    ptrs = (ctypes.c_void_p * nr)(*[c.data_ptr() for c in codes])
    sc = (ctypes.c_float * nr)(*scalers)
    rc = lib.tg_decode_sum(nr, ptrs, sc, int(shared), n, out.data_ptr(), nthreads or default_threads())
    _check(rc, "decode_mean")
    return rc == 0


def ternarize_pack_blocks(x: torch.Tensor, scalers: torch.Tensor, block: int, seed: int, step: int, rank: int,
                          tensor_id: int, out: torch.Tensor, nthreads: int | None = None,
                          r: torch.Tensor | None = None, r_out: torch.Tensor | None = None) -> None:
    """scalers: contiguous fp32 CPU tensor, one per block of `block` elements. r, r_out: as ternarize_pack."""
    _ternarize(x, scalers.data_ptr(), block, (seed, step, rank, tensor_id), out, nthreads, r, r_out,
               "ternarize_pack (block scalers)")


def decode_mean_blocks(codes: list[torch.Tensor], scalers: torch.Tensor, shared: bool, n: int, block: int,
                       out: torch.Tensor, nthreads: int | None = None) -> bool:
    """scalers: contiguous fp32 CPU tensor, (nranks, nblocks), or (nblocks,) when shared."""
    lib = _lib_or_raise()
    nr = len(codes)
    ptrs = (ctypes.c_void_p * nr)(*[c.data_ptr() for c in codes])
    rc = lib.tg_decode_sum_blocks(nr, ptrs, scalers.data_ptr(), int(shared), n, block, out.data_ptr(),
                                  nthreads or default_threads())
    _check(rc, "decode_mean (block scalers)")
    return rc == 0


def moments_blocks(x: torch.Tensor, block: int, absmax: torch.Tensor, nthreads: int | None = None,
                   r: torch.Tensor | None = None) -> tuple[float, float, float, int]:
    """moments() and block_absmax() into `absmax` (fp64) from one pass over x (or x + r)."""
    lib = _lib_or_raise()
    out = (ctypes.c_double * 4)()
    _check(lib.tg_stats_feedback(_DTYPES[x.dtype], x.data_ptr(), _ptr(r), x.numel(), block,
                                 nthreads or default_threads(), out, absmax.data_ptr()), "moments (block scalers)")
    return out[0], out[1], out[2], int(out[3])


def block_absmax(x: torch.Tensor, block: int, out: torch.Tensor, nthreads: int | None = None) -> None:
    """out: contiguous fp64 CPU tensor of ceil(n / block) elements."""
    lib = _lib_or_raise()
    _check(lib.tg_block_absmax(_DTYPES[x.dtype], x.data_ptr(), x.numel(), block, out.data_ptr(),
                               nthreads or default_threads()), "block_absmax")


def sum_shards(shards: torch.Tensor, nranks: int, out: torch.Tensor, nthreads: int | None = None) -> bool:
    """An owner's packed sums of the rows of `shards` into `out`; False when a code is invalid (0b11)."""
    lib = _lib_or_raise()
    ptrs = (ctypes.c_void_p * nranks)(*[shards[r].data_ptr() for r in range(nranks)])
    rc = lib.tg_sum_shards(nranks, ptrs, shards.shape[1], out.data_ptr(), nthreads or default_threads())
    _check(rc, "sum_code_shards")
    return rc == 0


def decode_packed_sums(packed: torch.Tensor, nranks: int, start: int, n: int, scaler: float, out: torch.Tensor,
                       nthreads: int | None = None) -> None:
    lib = _lib_or_raise()
    rc = lib.tg_decode_packed_sums(packed.data_ptr(), nranks, start, n, scaler, out.data_ptr(),
                                   nthreads or default_threads())
    _check(rc, "decode_packed_sums")


def _threads_for(n: int) -> int:
    """default_threads() where the fp16 wire's kernels would use them (2^22 elements or more: csrc/terngrad_half.cpp);
    reading it costs more than the kernel of a small tensor."""
    return default_threads() if n >= 1 << 22 else 1


def to_half(x: torch.Tensor, scale: float, out: torch.Tensor, nthreads: int | None = None) -> None:
    """out = fp16(x * scale): x contiguous fp32, out contiguous fp16, both on the CPU."""
    n = x.numel()
    _check(_lib_or_raise().tg_to_half(x.data_ptr(), n, scale, out.data_ptr(), nthreads or _threads_for(n)), "to_half")


def from_half(h: torch.Tensor, scale: float, out: torch.Tensor | None, only_finite: bool,
              nthreads: int | None = None) -> float:
    """The largest |h * scale| (NaN where h holds one); h * scale into out (contiguous fp32) where given, with
    only_finite only where that largest is finite."""
    m = ctypes.c_double()
    n = h.numel()
    _check(_lib_or_raise().tg_from_half(h.data_ptr(), n, scale, _ptr(out), int(only_finite), ctypes.byref(m),
                                        nthreads or _threads_for(n)), "from_half")
    return m.value


def scale(x: torch.Tensor, factor: float, nthreads: int | None = None) -> float:
    """x *= factor in place (contiguous fp32; factor rounded to fp32, as torch's x.mul_(factor)): the largest |x|
    after, NaN where x holds one. One pass."""
    n, out = x.numel(), ctypes.c_double()
    _check(_lib_or_raise().tg_scale(x.data_ptr(), n, factor, ctypes.byref(out), nthreads or _threads_for(n)),
           "scale")
    return out.value


def to_half_group(xs: list[torch.Tensor], scales: list[float], out: torch.Tensor, nthreads: int | None = None) -> None:
    """to_half of each x (contiguous fp32) back to back in out (contiguous fp16 of their total size), one call."""
    ns = array.array("q", [x.numel() for x in xs])  # held until the call returns: it reads them
    ptrs, f = array.array("q", [x.data_ptr() for x in xs]), array.array("f", scales)
    _check(_lib_or_raise().tg_to_half_group(len(xs), _addr(ptrs), _addr(ns), _addr(f), out.data_ptr(),
                                            nthreads or _threads_for(max(ns, default=0))), "to_half_group")


def from_half_group(h: torch.Tensor, sizes: list[int], scales: list[float], outs: list | None, only_finite: bool,
                    nthreads: int | None = None) -> list[float]:
    """from_half of each slice of h (sizes back to back) at its scale, into outs[j] (contiguous fp32, or None)
    where given; the largest of each, one call."""
    ns, f = array.array("q", sizes), array.array("f", scales)  # held until the call returns: it reads them
    found = array.array("d", bytes(8 * len(sizes)))
    ptrs = None if outs is None else array.array("q", [0 if o is None else o.data_ptr() for o in outs])
    _check(_lib_or_raise().tg_from_half_group(len(sizes), h.data_ptr(), _addr(ns), _addr(f),
                                              None if ptrs is None else _addr(ptrs), int(only_finite), _addr(found),
                                              nthreads or _threads_for(max(sizes, default=0))), "from_half_group")
    return found.tolist()


def _addr(a: array.array) -> int:
    """Where an array's items are: a group's pointers, sizes and scales go to the kernels as arrays of the array
    module, which cost a quarter of ctypes arrays to make (a group's call is made every step)."""
    return a.buffer_info()[0]


def philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    lib = _lib_or_raise()
    c = (ctypes.c_uint32 * 4)(*ctr)
    k = (ctypes.c_uint32 * 2)(*key)
    o = (ctypes.c_uint32 * 4)()
    lib.tg_philox4x32_10(c, k, o)
    return tuple(o)


class CpuBackend:
    """The C++ kernels (csrc/) as a codec backend (codec.Backend), with `nthreads` threads."""

    name = "cpu"

    def __init__(self, nthreads: int | None = None):
        self.nthreads = nthreads

    def moments(self, x, r=None):
        return moments(x, self.nthreads, r)

    def moments_blocks(self, x, block, r=None):
        absmax = torch.empty((x.numel() + block - 1) // block, dtype=torch.float64)
        return moments_blocks(x, block, absmax, self.nthreads, r), absmax

    def block_absmax(self, x, block):
        out = torch.empty((x.numel() + block - 1) // block, dtype=torch.float64)
        block_absmax(x, block, out, self.nthreads)
        return out

    def ternarize_pack(self, x, scaler, key, out, r=None, r_out=None):
        ternarize_pack(x, scaler, key.seed, key.step, key.rank, key.tensor_id, out, self.nthreads, r, r_out)

    def ternarize_pack_blocks(self, x, scalers, block, key, out, r=None, r_out=None):
        ternarize_pack_blocks(x, scalers.cpu(), block, key.seed, key.step, key.rank, key.tensor_id, out,
                              self.nthreads, r, r_out)

    def decode_mean(self, codes, scalers, shared, n, out):
        return decode_mean(codes, scalers, shared, n, out, self.nthreads)

    def decode_mean_blocks(self, codes, scalers, shared, n, block, out):
        return decode_mean_blocks(codes, scalers.cpu(), shared, n, block, out, self.nthreads)

    def sum_shards(self, shards, nranks, out):
        return sum_shards(shards, nranks, out, self.nthreads)

    def decode_packed_sums(self, packed, nranks, start, n, scaler, out):
        decode_packed_sums(packed, nranks, start, n, scaler, out, self.nthreads)

    def scale(self, x, factor):
        return scale(x, factor, self.nthreads)

    def scale_kernel(self) -> int:
        """tg_scale's address, for a caller in C++ (the DDP hook's C++ path, csrc/ddp_hook.cpp): the same pass as
        scale(), with no call through ctypes."""
        return ctypes.cast(_lib_or_raise().tg_scale, ctypes.c_void_p).value

    def threads_for(self, n: int) -> int:
        """The threads scale() gives a tensor of n elements."""
        return self.nthreads or _threads_for(n)

    def to_half(self, x, scale, out):
        if x.dtype != torch.float32:  # the kernel reads fp32 gradients, by far the usual ones
            return reference.to_half(x, scale, out)
        to_half(x, scale, out, self.nthreads)

    def from_half(self, h, scale, out, only_finite):
        if out is not None and (out.dtype != torch.float32 or not out.is_contiguous()):  # the kernel writes these
            return reference.from_half(h, scale, out, only_finite)
        return from_half(h, 1.0 / scale, out, only_finite, self.nthreads)

    def to_halves(self, xs, scales, out):
        for x in xs:
            if x.dtype != torch.float32:  # the kernel reads fp32; the others each by themselves
                return reference.to_halves(xs, scales, out, self.to_half)
        to_half_group(xs, scales, out, self.nthreads)

    def from_halves(self, h, sizes, scales, outs, only_finite):
        for o in outs or ():
            if o is not None and (o.dtype != torch.float32 or not o.is_contiguous()):  # what the kernel writes
                return reference.from_halves(h, sizes, scales, outs, only_finite, self.from_half)
        return from_half_group(h, sizes, [1.0 / s for s in scales], outs, only_finite, self.nthreads)
