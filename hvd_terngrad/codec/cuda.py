"""GPU backend: CuPy RawKernels (terngrad_kernels.cu beside this file) on torch CUDA tensors, zero copy.

torch tensors are wrapped as CuPy arrays over the same device memory (no copy), and the kernels run on
torch's current stream. Without CuPy this module still imports; available() is then False and the
dispatcher in codec/__init__.py never picks it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hvd_terngrad.codec import reference

try:  # CuPy is optional: everything on the CPU works without it
    import cupy as cp
except ImportError:  # pragma: no cover - depends on the machine
    cp = None

SOURCE = Path(__file__).with_name("terngrad_kernels.cu")
_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16"}
_CUPY_DTYPE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.uint16,
               torch.bfloat16: np.uint16, torch.uint8: np.uint8, torch.int64: np.int64}
# What CuPy's RawModule gets; benchmarks/kernel_resources.py compiles with the same options in CI.
NVRTC_OPTIONS = ("-std=c++17",)
_THREADS = 256
_STAT_BLOCKS = 1024
_module = None


def available() -> bool:
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def _kernels():
    global _module
    if cp is None:
        raise RuntimeError("the CUDA codec backend needs CuPy (pip install cupy-cuda12x)")
    if _module is None:
        _module = cp.RawModule(code=SOURCE.read_text(), options=NVRTC_OPTIONS)
    return _module


def _wrap(t: torch.Tensor):
    """A CuPy view of a contiguous torch CUDA tensor (same memory, no copy)."""
    mem = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, device_id=t.device.index)
    return cp.ndarray((t.numel(),), dtype=_CUPY_DTYPE[t.dtype], memptr=cp.cuda.MemoryPointer(mem, 0))


class _OnTorchStream:
    def __init__(self, t: torch.Tensor):
        self.dev = cp.cuda.Device(t.device.index)
        self.stream = cp.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream, t.device.index)

    def __enter__(self):
        self.dev.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.dev.__exit__(*exc)


def _or_null(t: torch.Tensor | None):
    """A kernel's pointer argument: t's memory, or a null pointer (8 bytes by value)."""
    return np.uint64(0) if t is None else _wrap(t)


def moments(x: torch.Tensor, r: torch.Tensor | None = None) -> tuple[float, float, float, int]:
    """Moments of x, or of x + r (error feedback)."""
    n = x.numel()
    if n == 0:
        return 0.0, 0.0, 0.0, 0
    big = float(np.finfo(np.float64 if x.dtype == torch.float64 else np.float32).max)
    blocks = min(_STAT_BLOCKS, (n + _THREADS - 1) // _THREADS)
    chunk = (n + blocks - 1) // blocks
    with _OnTorchStream(x):
        ps, pq, pm = (cp.empty(blocks, dtype=cp.float64) for _ in range(3))
        pb = cp.empty(blocks, dtype=cp.uint64)
        k = _kernels().get_function(f"tg_stats_partial_{_SUFFIX[x.dtype]}")
        k((blocks,), (_THREADS,), (_wrap(x), _or_null(r), np.int64(n), np.int64(chunk), np.float64(big), ps, pq, pm,
                                   pb))
        s_, q_, m_, b_ = ps.get(), pq.get(), pm.get(), pb.get()
    x0 = float((x[0] if r is None else x[0] + r[0]).item())  # torch rounds the sum as the kernel does
    s = q = 0.0
    for i in range(blocks):  # block order: deterministic on a given device
        s += float(s_[i])
        q += float(q_[i])
    md = s / n
    var = max(0.0, q / n - md * md)
    return x0 + md, var ** 0.5, float(m_.max()), int(b_.sum())


def ternarize_pack(x: torch.Tensor, scaler: float, key, out: torch.Tensor, r: torch.Tensor | None = None,
                   r_out: torch.Tensor | None = None) -> None:
    """Codes of x (or of x + r); with r_out, the residual too (docs/wire-format.md, section 13)."""
    n = x.numel()
    if n == 0:
        return
    if r_out is not None:
        sc = torch.tensor([scaler], dtype=torch.float32, device=x.device)
        return _ternarize_feedback(x, r, sc, max(n, 1), key, out, r_out)
    nblk = (n + 7) // 8
    s17 = np.float32(scaler) * np.float32(2.0**-17)
    with _OnTorchStream(x):
        k = _kernels().get_function(f"tg_ternarize_pack_{_SUFFIX[x.dtype]}")
        k(((nblk + _THREADS - 1) // _THREADS,), (_THREADS,),
          (_wrap(x), np.int64(n), np.float32(s17), *_key_args(key), _wrap(out)))


def _key_args(key) -> tuple:
    return (np.uint32(key.seed & 0xFFFFFFFF), np.uint32(key.seed >> 32), np.uint32(key.rank << 16),
            np.uint32(key.tensor_id), np.uint32(key.step))


def ternarize_pack_blocks(x: torch.Tensor, scalers: torch.Tensor, block: int, key, out: torch.Tensor,
                          r: torch.Tensor | None = None, r_out: torch.Tensor | None = None) -> None:
    """scalers: fp32, one per block of `block` elements (moved to x's device). r, r_out: as ternarize_pack."""
    n = x.numel()
    if n == 0:
        return
    if r_out is not None:
        return _ternarize_feedback(x, r, scalers.to(device=x.device, dtype=torch.float32), block, key, out, r_out)
    nblk = (n + 7) // 8
    sc = scalers.to(device=x.device, dtype=torch.float32) * 2.0**-17  # fl32(s * 2^-17), no flush to zero
    with _OnTorchStream(x):
        k = _kernels().get_function(f"tg_ternarize_pack_blocks_{_SUFFIX[x.dtype]}")
        k(((nblk + _THREADS - 1) // _THREADS,), (_THREADS,),
          (_wrap(x), np.int64(n), _wrap(sc), np.int64(block), *_key_args(key), _wrap(out)))


def _ternarize_feedback(x, r, scalers, block, key, out, r_out) -> None:
    """The fused error-feedback kernel; scalers: fp32 on x's device, one per block (block >= n: one scaler)."""
    n = x.numel()
    nblk = (n + 7) // 8
    s17 = (scalers * 2.0**-17).contiguous()
    with _OnTorchStream(x):
        k = _kernels().get_function(f"tg_ternarize_pack_feedback_{_SUFFIX[x.dtype]}")
        k(((nblk + _THREADS - 1) // _THREADS,), (_THREADS,),
          (_wrap(x), _or_null(r), np.int64(n), _wrap(s17), _wrap(scalers.contiguous()), np.int64(block),
           *_key_args(key), _wrap(out), _wrap(r_out)))


def block_absmax(x: torch.Tensor, block: int, r: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 per block of `block` elements: max|x| (or max|x + r|), NaN ignored."""
    n = x.numel()
    nb = (n + block - 1) // block
    out = torch.zeros(nb, dtype=torch.float64, device=x.device)
    if n:
        nblk = (n + 7) // 8
        with _OnTorchStream(x):
            k = _kernels().get_function(f"tg_block_absmax_{_SUFFIX[x.dtype]}")
            k(((nblk + _THREADS - 1) // _THREADS,), (_THREADS,),
              (_wrap(x), _or_null(r), np.int64(n), np.int64(block), _wrap(out.view(torch.int64)).view(cp.uint64)))
    return out


def decode_mean(codes: list[torch.Tensor], weights: torch.Tensor, block: int, shared: bool, n: int,
                out: torch.Tensor) -> bool:
    """weights: fp32 fl32(s / nranks), (nranks, nblocks) or, shared, (1, nblocks); one block: block >= n."""
    if n == 0:
        return True
    nr = len(codes)
    nbytes = (n + 3) // 4
    with _OnTorchStream(out):
        ptrs = cp.asarray(np.array([c.data_ptr() for c in codes], dtype=np.uint64))
        w = weights.to(device=out.device, dtype=torch.float32).contiguous()
        bad = cp.zeros(1, dtype=cp.int32)
        k = _kernels().get_function("tg_decode_sum")
        k(((nbytes + _THREADS - 1) // _THREADS,), (_THREADS,),
          (ptrs, np.int32(nr), _wrap(w), np.int64(w.shape[-1]), np.int64(block), np.int32(int(shared)), np.int64(n),
           _wrap(out), bad))
        return int(bad.get()[0]) == 0


def sum_shards(shards: torch.Tensor, nranks: int, bits: int, out: torch.Tensor) -> bool:
    """An owner's packed sums of the rows of `shards` into `out`; False when a code is invalid (0b11)."""
    shard_bytes = shards.shape[1]
    if shard_bytes == 0:
        return True
    with _OnTorchStream(shards):
        ptrs = cp.asarray(np.array([shards[r].data_ptr() for r in range(nranks)], dtype=np.uint64))
        bad = cp.zeros(1, dtype=cp.int32)
        k = _kernels().get_function("tg_sum_shards")
        k(((shard_bytes + _THREADS - 1) // _THREADS,), (_THREADS,),
          (ptrs, np.int32(nranks), np.int64(shard_bytes), np.int32(bits), _wrap(out), bad))
        return int(bad.get()[0]) == 0


def decode_packed_sums(packed: torch.Tensor, nranks: int, bits: int, start: int, n: int, scaler: float,
                       out: torch.Tensor) -> None:
    if n == 0:
        return
    post = np.float32(scaler) / np.float32(nranks)
    with _OnTorchStream(out):
        k = _kernels().get_function("tg_decode_packed_sums")
        k(((n + _THREADS - 1) // _THREADS,), (_THREADS,),
          (_wrap(packed), np.int32(nranks), np.int32(bits), np.int64(start), np.int64(n), np.float32(post), _wrap(out)))


class CudaBackend:
    """The CUDA kernels as a codec backend (codec.Backend), on torch's current stream."""

    name = "cuda"

    def __init__(self, nthreads: int | None = None):
        del nthreads  # the GPU decides its own parallelism

    moments = staticmethod(moments)
    block_absmax = staticmethod(block_absmax)
    ternarize_pack = staticmethod(ternarize_pack)
    ternarize_pack_blocks = staticmethod(ternarize_pack_blocks)

    def moments_blocks(self, x, block, r=None):
        return moments(x, r), block_absmax(x, block, r)

    # the 16-bit wire: torch's own ops, which run as one kernel each on the GPU
    to_half = staticmethod(reference.to_half)
    from_half = staticmethod(reference.from_half)
    scale = staticmethod(reference.scale)
    to_halves = staticmethod(reference.to_halves)
    from_halves = staticmethod(reference.from_halves)

    def decode_mean(self, codes, scalers, shared, n, out):
        w = torch.tensor(scalers[:1] if shared else scalers, dtype=torch.float32) / len(codes)
        return decode_mean(codes, w.view(-1, 1), max(n, 1), shared, n, out)

    def decode_mean_blocks(self, codes, scalers, shared, n, block, out):
        nb = (n + block - 1) // block
        return decode_mean(codes, scalers.reshape(-1, nb) / len(codes), block, shared, n, out)

    def sum_shards(self, shards, nranks, out):
        from hvd_terngrad.wire import sum_bits

        return sum_shards(shards, nranks, sum_bits(nranks), out)

    def decode_packed_sums(self, packed, nranks, start, n, scaler, out):
        from hvd_terngrad.wire import sum_bits

        decode_packed_sums(packed, nranks, sum_bits(nranks), start, n, scaler, out)
