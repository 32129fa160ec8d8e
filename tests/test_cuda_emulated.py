"""The CUDA kernels' logic, run on the host: terngrad_kernels.cu compiled by g++ with a small shim
(tests/cuda_emul/emulate.cpp) that plays the grid thread by thread. Machines without a GPU thereby still
check that the GPU kernels write the reference's bytes; a GPU session runs benchmarks/gpu_check.py too."""
import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hvd_terngrad import codec
from hvd_terngrad.codec import reference
from tests.golden.make_golden import golden_input

HERE = Path(__file__).parent
GOLDEN = json.loads((HERE / "golden" / "codec_v1.json").read_text())
DT = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not installed")
    so = tmp_path_factory.mktemp("emu") / "emu.so"
    subprocess.run([cxx, "-O1", "-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas", "-shared", "-fPIC",
                    "-o", str(so), str(HERE / "cuda_emul" / "emulate.cpp")], check=True, timeout=300)
    lib = ctypes.CDLL(str(so))
    u32 = ctypes.c_uint32
    lib.emu_ternarize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float, u32, u32, u32, u32,
                                  u32, ctypes.c_void_p]
    lib.emu_sum_shards.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    lib.emu_decode_packed_sums.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                           ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p]
    ll = ctypes.c_longlong
    lib.emu_decode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ll, ll, ctypes.c_int, ll,
                               ctypes.c_void_p]
    lib.emu_ternarize_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p, ll, ctypes.c_void_p, ll, u32, u32, u32, u32,
                                         u32, ctypes.c_void_p]
    lib.emu_block_absmax.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ll, ll, ctypes.c_void_p]
    vp = ctypes.c_void_p
    lib.emu_ternarize_feedback.argtypes = [ctypes.c_int, vp, vp, ll, vp, vp, ll, u32, u32, u32, u32, u32, vp, vp]
    return lib


def gpu_ternarize(lib, x, scaler, key):
    x = x.contiguous()
    out = torch.zeros((x.numel() + 3) // 4, dtype=torch.uint8)
    s17 = np.float32(scaler) * np.float32(2.0**-17)
    lib.emu_ternarize(DT[x.dtype], x.data_ptr(), x.numel(), float(s17), key.seed & 0xFFFFFFFF, key.seed >> 32,
                      key.rank << 16, key.tensor_id, key.step, out.data_ptr())
    return out


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_gpu_kernel_golden_vectors(emu, case):
    x = golden_input(case["n"], case["dtype"])
    key = codec.RngKey(case["seed"], case["step"], case["rank"], case["tensor_id"])
    assert bytes(gpu_ternarize(emu, x, case["scaler"], key).tolist()).hex() == case["packed_hex"]


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("n", [1, 5, 8, 9, 1000, 4099])
def test_gpu_kernels_match_reference(emu, dtype, n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 0.02).to(dtype)
    key = codec.RngKey(99, 3, 2, 0x1234)
    a = gpu_ternarize(emu, x, 0.03, key)
    b = reference.ternarize_pack(x, 0.03, 99, 3, 2, 0x1234)
    assert torch.equal(a, b)
    c = gpu_ternarize(emu, x, 0.01, key)
    for shared, scalers in ((True, [0.03, 0.03]), (False, [0.03, 0.01])):
        ptrs = np.array([a.data_ptr(), c.data_ptr()], dtype=np.uint64)
        w = np.array([np.float32(s) / np.float32(2) for s in scalers], dtype=np.float32)
        out = torch.empty(n, dtype=torch.float32)
        bad = emu.emu_decode(ptrs.ctypes.data, 2, w.ctypes.data, 1, max(n, 1), int(shared), n, out.data_ptr())
        ref, ok = reference.decode_mean([a, c], scalers, shared, n)
        assert bad == 0 and ok
        assert torch.equal(out, ref)


SHARDED = json.loads((HERE / "golden" / "sharded_v1.json").read_text())


@pytest.mark.parametrize("case", SHARDED["cases"], ids=lambda c: f"N{c['nranks']}")
def test_gpu_sharded_kernels_write_the_golden_sums_and_decode_them(emu, case):
    """tg_sum_shards and tg_decode_packed_sums, played on the host, against section 10's golden bytes."""
    from hvd_terngrad import wire
    from tests.golden.make_golden import sharded_stream

    n, shard = case["nranks"], case["shard_bytes"]
    bits = wire.sum_bits(n)
    streams = [sharded_stream(n, r) for r in range(n)]
    sums = []
    for j in range(n):
        rows = [s[j * shard:(j + 1) * shard].contiguous() for s in streams]
        ptrs = np.array([r.data_ptr() for r in rows], dtype=np.uint64)
        out = torch.zeros(wire.sums_size(shard, n), dtype=torch.uint8)
        assert emu.emu_sum_shards(ptrs.ctypes.data, n, shard, bits, out.data_ptr()) == 0
        sums.append(out)
    packed = torch.cat(sums)
    assert bytes(packed.tolist()).hex() == case["sums_hex"]
    post = np.float32(0.5) / np.float32(n)
    for start, k in [(0, 13), (16, 64), (4 * shard * n - 8, 5)]:
        out = torch.empty(k, dtype=torch.float32)
        emu.emu_decode_packed_sums(packed.data_ptr(), n, bits, start, k, float(post), out.data_ptr())
        assert torch.equal(out, codec.decode_packed_sums(packed, n, start, k, 0.5, backend="reference"))


BLOCKS = json.loads((HERE / "golden" / "codec_v2.json").read_text())


def gpu_ternarize_blocks(lib, x, scalers, block, key):
    x = x.contiguous()
    out = torch.zeros((x.numel() + 3) // 4, dtype=torch.uint8)
    sc = (scalers.float() * 2.0**-17).contiguous()
    lib.emu_ternarize_blocks(DT[x.dtype], x.data_ptr(), x.numel(), sc.data_ptr(), block, key.seed & 0xFFFFFFFF,
                             key.seed >> 32, key.rank << 16, key.tensor_id, key.step, out.data_ptr())
    return out


@pytest.mark.parametrize("case", BLOCKS["cases"], ids=lambda c: c["name"])
def test_gpu_block_kernels_golden_vectors(emu, case):
    """Version 2 (block scalers): the GPU kernels' block maxima, codes and decode, played on the host."""
    from tests.golden.make_golden import block_case

    x, scalers, block, key = block_case(case)
    n = x.numel()
    bits = torch.zeros(codec.num_blocks(n, block), dtype=torch.int64)
    emu.emu_block_absmax(DT[x.dtype], x.contiguous().data_ptr(), None, n, block, bits.data_ptr())
    assert torch.equal(bits.view(torch.float64), reference.block_absmax(x, block))
    codes = gpu_ternarize_blocks(emu, x, scalers, block, key)
    assert bytes(codes.tolist()).hex() == case["packed_hex"]
    other = gpu_ternarize_blocks(emu, x.flip(0), scalers.flip(0), block, key)
    rows = torch.stack([scalers, scalers.flip(0)])
    ptrs = np.array([codes.data_ptr(), other.data_ptr()], dtype=np.uint64)
    for shared in (True, False):
        w = ((rows[:1] if shared else rows) / 2).contiguous()
        out = torch.empty(n, dtype=torch.float32)
        assert emu.emu_decode(ptrs.ctypes.data, 2, w.data_ptr(), w.shape[1], block, int(shared), n,
                              out.data_ptr()) == 0
        ref, ok = reference.decode_mean_blocks([codes, other], rows[0] if shared else rows, shared, n, block)
        assert ok and torch.equal(out, ref)


FEEDBACK = json.loads((HERE / "golden" / "feedback_v1.json").read_text())


def gpu_ternarize_feedback(lib, g, r, scalers, block, key, r_out):
    """tg_ternarize_pack_feedback as cuda.py launches it: scalers one float (block = 0) or fp32 per block."""
    n = g.numel()
    sc = torch.tensor([scalers], dtype=torch.float32) if not block else scalers.float().contiguous()
    s17 = (sc * 2.0**-17).contiguous()
    out = torch.zeros((n + 3) // 4, dtype=torch.uint8)
    lib.emu_ternarize_feedback(DT[g.dtype], g.data_ptr(), None if r is None else r.data_ptr(), n, s17.data_ptr(),
                               sc.data_ptr(), block or 2**62, key.seed & 0xFFFFFFFF, key.seed >> 32, key.rank << 16,
                               key.tensor_id, key.step, out.data_ptr(), r_out.data_ptr())
    return out


@pytest.mark.parametrize("case", FEEDBACK["cases"], ids=lambda c: c["name"])
def test_gpu_feedback_kernel_golden_vectors(emu, case):
    """Error feedback fused into the GPU ternarizer (section 13): codes of g + r, the residual over r in place; and
    the block maxima of g + r."""
    from tests.golden.make_golden import feedback_case

    g, r, scalers, key = feedback_case(case)
    block = case["block_size"]
    if block:
        bits = torch.zeros(codec.num_blocks(g.numel(), block), dtype=torch.int64)
        emu.emu_block_absmax(DT[g.dtype], g.data_ptr(), r.data_ptr(), g.numel(), block, bits.data_ptr())
        assert torch.equal(bits.view(torch.float64), reference.block_absmax(g + r, block))
    codes = gpu_ternarize_feedback(emu, g, r, scalers, block, key, r)
    assert bytes(codes.tolist()).hex() == case["packed_hex"]
    assert bytes(r.view(torch.uint8).tolist()).hex() == case["residual_hex"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_gpu_feedback_kernel_matches_reference_without_a_residual_and_at_the_edges(emu, dtype):
    """No residual to add (the first step, an owner's shard), and fp16/bf16 sums across the whole range."""
    gen = torch.Generator().manual_seed(3)
    if dtype in (torch.float16, torch.bfloat16):
        g, r = torch.randint(-2**15, 2**15, (2, 20_000), generator=gen, dtype=torch.int16).view(dtype)
        ok = torch.isfinite(g) & torch.isfinite(r)
        g, r, s = g[ok].contiguous(), r[ok].contiguous(), 60000.0
    else:
        g, r = (torch.randn(2, 1001, generator=gen, dtype=torch.float64) * 0.02).to(dtype)
        g, r, s = g.contiguous(), r.contiguous(), 0.03
    key = codec.RngKey(9, 8, 7, 6)
    for r_in in (None, r):
        ref_out = torch.empty_like(g)
        ref = codec.ternarize_pack(g, s, key, residual=r_in, residual_out=ref_out, backend="reference")
        got_out = torch.empty_like(g)
        assert torch.equal(gpu_ternarize_feedback(emu, g, r_in, s, 0, key, got_out), ref)
        same = (got_out.view(torch.uint8) == ref_out.view(torch.uint8)) | torch.isnan(ref_out).repeat_interleave(
            ref_out.element_size())
        assert bool(same.all())
