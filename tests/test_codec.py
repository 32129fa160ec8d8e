"""The codec: golden bytes, backend agreement, round trips, unbiasedness, clipping, edge cases."""
import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hvd_terngrad import codec
from hvd_terngrad.codec import cpu, reference
from tests.golden.make_golden import feedback_case, golden_input

GOLDEN = json.loads((Path(__file__).parent / "golden" / "codec_v1.json").read_text())
FEEDBACK = json.loads((Path(__file__).parent / "golden" / "feedback_v1.json").read_text())
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def backends():
    out = ["reference", "cpu"]
    try:
        from hvd_terngrad.codec import cuda

        if cuda.available():
            out.append("cuda")
    except ImportError:
        pass
    return out


def _dev(backend):
    return "cuda" if backend == "cuda" else "cpu"


def _simd_levels():
    top = cpu.set_simd_level(3)
    return [lvl for lvl in (3, 2, 0) if lvl <= top]


@pytest.fixture(params=_simd_levels(), ids=lambda lvl: cpu.SIMD_LEVELS[lvl])
def simd(request):
    """Run the test on each SIMD path this CPU has (AVX-512, AVX2, scalar): all must write the same bytes."""
    assert cpu.set_simd_level(request.param) == request.param
    yield request.param
    cpu.set_simd_level(3)


# ---------------------------------------------------------------------------------------------
def test_cpu_library_loaded():
    assert cpu.available(), cpu.load_error()


@pytest.mark.parametrize("ctr,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, expected):
    """Random123's published known-answer vectors for Philox4x32-10, on both CPU and reference."""
    assert cpu.philox4x32_10(ctr, key) == expected
    words = reference.philox4x32_10(*[torch.tensor([c]) for c in ctr], *key)
    assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("backend", backends())
def test_golden_vectors(case, backend):
    x = golden_input(case["n"], case["dtype"]).to(_dev(backend))
    key = codec.RngKey(case["seed"], case["step"], case["rank"], case["tensor_id"])
    packed = codec.ternarize_pack(x, case["scaler"], key, backend=backend)
    assert bytes(packed.cpu().tolist()).hex() == case["packed_hex"]
    got = codec.moments(x, backend=backend)
    exp = case["stats"]
    if backend == "cuda":  # a tree reduction on the GPU: equal to ~1 ulp of double, not bit for bit
        assert got.mean == pytest.approx(exp[0], rel=1e-12, abs=1e-15)
        assert got.std == pytest.approx(exp[1], rel=1e-12)
        assert got.absmax == exp[2] and got.nonfinite == exp[3]
    else:
        assert tuple(got) == tuple(exp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 63, 64, 65, 129, 1000, 16384 + 13, 300_001])
def test_cpu_matches_reference_bit_for_bit(dtype, n, simd):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    key = codec.RngKey(2**40 + 3, 11, 5, 0xABCDEF01)
    s = 0.03
    a = codec.ternarize_pack(x, s, key, backend="cpu", nthreads=1)
    b = codec.ternarize_pack(x, s, key, backend="reference")
    assert torch.equal(a, b)
    for nt in (2, 3, 8):  # whatever the thread count
        assert torch.equal(codec.ternarize_pack(x, s, key, backend="cpu", nthreads=nt), a)
        assert codec.moments(x, backend="cpu", nthreads=nt) == codec.moments(x, backend="cpu", nthreads=1)
    if n <= 70_000:  # the reference stats loop is slow
        assert codec.moments(x, backend="cpu") == codec.moments(x, backend="reference")
    if n:
        other = codec.ternarize_pack(x, s * 0.5, key, backend="cpu")
        for shared in (True, False):
            scalers = [s, s, s] if shared else [s, s * 0.5, s * 0.25]
            d1 = codec.decode_mean([a, other, a], scalers, shared, n, backend="cpu", nthreads=3)
            d2 = codec.decode_mean([a, other, a], scalers, shared, n, backend="reference")
            assert torch.equal(d1, d2)


def test_decode_many_ranks_beyond_int8_counters(simd):
    """Shared decode of 200 ranks (past the 127 the int8 AVX-512 counters hold) equals the reference."""
    n = 1000
    codes = [codec.ternarize_pack(torch.randn(n), 1.0, codec.RngKey(5, 0, r, 9)) for r in range(200)]
    got = codec.decode_mean(codes, [1.0] * 200, True, n, backend="cpu")
    ref = codec.decode_mean(codes, [1.0] * 200, True, n, backend="reference")
    assert torch.equal(got, ref)


# ---------------------------------------------------------------------------------------------
# Error feedback fused into the coding (wire format section 13).
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns: -0.0 and +0.0 differ, as they would on the wire of a later step."""
    return t.contiguous().view(_BITS[t.dtype]).cpu()


def _code_feedback(g, scalers, block, key, r, r_out, **kw):
    if block:
        return codec.ternarize_pack_blocks(g, scalers, block, key, residual=r, residual_out=r_out, **kw)
    return codec.ternarize_pack(g, scalers, key, residual=r, residual_out=r_out, **kw)


@pytest.mark.parametrize("case", FEEDBACK["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("backend", backends())
def test_feedback_golden_vectors(case, backend):
    """Codes, residual and moments of g + r: the residual written over r in place."""
    g, r, scalers, key = feedback_case(case)
    g, r = g.to(_dev(backend)), r.to(_dev(backend))
    if case["block_size"]:
        scalers = scalers.to(_dev(backend))
    before = r.clone()
    packed = _code_feedback(g, scalers, case["block_size"], key, r, r, backend=backend)
    assert bytes(packed.cpu().tolist()).hex() == case["packed_hex"]
    assert bytes(r.cpu().view(torch.uint8).tolist()).hex() == case["residual_hex"]
    got = codec.moments(g, residual=before, backend=backend)
    if backend == "cuda":
        assert got.mean == pytest.approx(case["stats"][0], rel=1e-12, abs=1e-15)
        assert got.absmax == case["stats"][2]
    else:
        assert list(got) == case["stats"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 1000, 16384 + 13, 300_001])
@pytest.mark.parametrize("block", [0, 64, 4096])
def test_feedback_matches_reference_bit_for_bit(dtype, n, block, simd):
    """Every SIMD path and thread count writes the reference's codes and residual, with and without a residual
    to add, the new residual over the old one."""
    gen = torch.Generator().manual_seed(n + block)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.02).to(dtype)
    r = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.005).to(dtype)
    scalers = (torch.rand(codec.num_blocks(n, block), generator=gen) * 0.04 + 0.001) if block else 0.03
    key = codec.RngKey(2**40 + 3, 11, 5, 0xABCDEF01)
    for r_in in (r, None):
        ref_out = torch.empty_like(g)
        ref = _code_feedback(g, scalers, block, key, r_in, ref_out, backend="reference")
        for nt in (1, 3):
            rr = r.clone()
            got = _code_feedback(g, scalers, block, key, rr if r_in is not None else None, rr, backend="cpu",
                                 nthreads=nt)
            assert torch.equal(got, ref)
            assert torch.equal(_bits(rr), _bits(ref_out))
        if block == 0:  # codes of g + r are the codes of that sum formed first
            x = g if r_in is None else g + r_in
            assert torch.equal(ref, codec.ternarize_pack(x, scalers, key, backend="cpu"))
    x = g + r
    for nt in (1, 3):
        assert codec.moments(g, residual=r, backend="cpu", nthreads=nt) == codec.moments(x, backend="cpu", nthreads=nt)
        if block:
            st, am = codec.moments_blocks(g, block, residual=r, backend="cpu", nthreads=nt)
            st2, am2 = codec.moments_blocks(x, block, backend="cpu", nthreads=nt)
            assert st == st2 and torch.equal(am, am2)
    if n <= 70_000:
        assert codec.moments(g, residual=r, backend="cpu") == codec.moments(g, residual=r, backend="reference")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_feedback_rounds_as_torch_across_the_whole_range(dtype, simd):
    """fp16 and bf16 sums and differences round as torch's do: subnormals, ties, overflow to Inf included."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-2**15, 2**15, (2, 200_000), generator=gen, dtype=torch.int16)
    g, r = bits.view(dtype)
    finite = torch.isfinite(g) & torch.isfinite(r)
    g, r = g[finite].contiguous(), r[finite].contiguous()
    s = float(torch.tensor(60000.0 if dtype == torch.float16 else 1e30, dtype=dtype))
    key = codec.RngKey(1, 2, 3, 4)
    ref_out, rr = torch.empty_like(g), r.clone()
    ref = codec.ternarize_pack(g, s, key, residual=r, residual_out=ref_out, backend="reference")
    got = codec.ternarize_pack(g, s, key, residual=rr, residual_out=rr, backend="cpu")
    assert torch.equal(got, ref)
    same = (_bits(rr) == _bits(ref_out)) | (torch.isnan(rr) & torch.isnan(ref_out))
    assert bool(same.all()), f"{int((~same).sum())} residuals differ"


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 63, 64, 65, 1000, 300_001, (1 << 22) + 5])
def test_the_fp32_wire_scales_in_place_with_torchs_bits_and_reads_the_largest_value(n, simd):
    """Codec.scale (the DDP hook's own fp32 average, before its Sum) on the C++ paths against torch's x.mul_:
    every fp32 bit pattern (subnormals, overflow to Inf) times factors that are and are not powers of two, and
    the largest |value| after, an Inf's and a NaN's included."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)  # NaN's payload aside, checked below
    for factor in (1.0 / 3, 0.25, 1.0 / 7, 2.0 ** 100):
        got, ref = x.clone(), x.clone()
        m = codec.scale(got, factor, backend="cpu")
        assert _same_float(m, reference.scale(ref, factor))
        assert torch.equal(_bits(got), _bits(ref)), factor
    if n:
        y = torch.randn(n, generator=gen)
        y[n // 2] = -math.inf
        assert codec.scale(y, 0.5, backend="cpu") == math.inf
        y[n - 1] = math.nan
        assert math.isnan(codec.scale(y, 0.5, backend="cpu"))


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 63, 64, 65, 1000, 300_001, (1 << 22) + 5])
def test_the_16_bit_wire_gives_torchs_bits_each_way_and_the_largest_value(n, simd):
    """Codec.to_half and from_half (the fp16 wire of an uncoded average) on the C++ paths against torch's ops:
    every fp32 bit pattern's product rounded as torch rounds it (subnormal halves, ties, overflow to Inf), and
    back with the largest |value|, NaN carried, and with only_finite a non-finite average leaving out alone."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)  # NaN's payload aside, checked below
    for scale in (2.0 ** -120, 2.0 ** -20, 1.0, 2.0 ** 30):
        got = codec.to_half(x, scale, backend="cpu")
        ref = torch.empty(n, dtype=torch.float16)
        reference.to_half(x, scale, ref)
        assert torch.equal(_bits(got), _bits(ref)), scale
        for only_finite in (False, True):
            out, ref_out = torch.full((n,), 7.0), torch.full((n,), 7.0)
            m = codec.from_half(got, scale, out=out, only_finite=only_finite, backend="cpu")
            assert _same_float(m, reference.from_half(ref, scale, ref_out, only_finite))
            assert torch.equal(out, ref_out)
    h = torch.randn(n, generator=gen).half()
    assert _same_float(codec.from_half(h, 4.0, backend="cpu"), float(h.float().abs().max()) / 4 if n else 0.0)
    if n:
        h[n // 2] = math.nan
        out = torch.full((n,), 7.0)
        assert math.isnan(codec.from_half(h, 4.0, out=out, only_finite=True, backend="cpu"))
        assert bool((out == 7.0).all())  # left as it was
        assert torch.isnan(codec.to_half(torch.tensor([math.nan] * 17), 2.0, backend="cpu")).all()


def test_the_16_bit_wire_takes_any_float_gradient_and_rejects_the_wrong_tensors():
    x = torch.randn(4, 33)
    for dtype in DTYPES:  # the kernel reads fp32; the others take torch's path, with the same result
        y = x.to(dtype)
        assert torch.equal(codec.to_half(y, 8.0), (y.float() * 8).half()), dtype
    out = torch.empty(4, 33, dtype=torch.float16)
    assert codec.to_half(x.t(), 2.0, out=out).shape == (4, 33)  # non-contiguous input, made contiguous
    with pytest.raises(ValueError, match="contiguous fp16 tensor of 132"):
        codec.to_half(x, 2.0, out=torch.empty(131, dtype=torch.float16))
    with pytest.raises(ValueError, match="reads a contiguous fp16"):
        codec.from_half(x, 2.0)
    with pytest.raises(ValueError, match="out has 131 elements"):
        codec.from_half(x.half(), 2.0, out=torch.empty(131))
    h = (x * 2).half()
    for out in (torch.empty(4, 33, dtype=torch.float64), torch.empty(33, 4).t()):  # another dtype, a strided view
        assert codec.from_half(h, 2.0, out=out) == float(h.float().abs().max()) / 2
        assert torch.equal(out, h.to(out.dtype) / 2)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_groups_16_bit_wire_in_one_call_gives_each_tensors_bits(backend, simd):
    """Codec.to_halves and from_halves (one call a group) give the bits of to_half and from_half a tensor at a
    time: sizes around the SIMD widths, an empty tensor, another dtype and a strided destination (the per-tensor
    path inside the call), and with only_finite a non-finite member left alone while the others are written."""
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 0, 17, 64, 1000, 65, 3]
    xs = [torch.randn(n, generator=gen) * 2.0 ** (k - 3) for k, n in enumerate(sizes)]
    scales = [2.0 ** e for e in (-4, 0, 9, 3, 12, -1, 20)]
    c = codec.Codec(backend)
    got = c.to_halves(xs, scales, torch.empty(sum(sizes), dtype=torch.float16))
    want = torch.cat([codec.to_half(x, s, backend=backend) for x, s in zip(xs, scales)])
    assert torch.equal(_bits(got), _bits(want))
    got[sizes[0] + sizes[1] + 5] = math.nan  # in the third member
    outs, ref_outs = [torch.full((n,), 7.0) for n in sizes], [torch.full((n,), 7.0) for n in sizes]
    found = c.from_halves(got, sizes, scales, outs, only_finite=True)
    parts = got.split(sizes)
    want = [codec.from_half(h, s, out=o, only_finite=True, backend=backend)
            for h, s, o in zip(parts, scales, ref_outs)]
    assert all(_same_float(a, b) for a, b in zip(found, want)) and math.isnan(found[2])
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs)) and bool((outs[2] == 7.0).all())
    assert all(_same_float(a, b) for a, b in zip(c.from_halves(got, sizes, scales), want))  # measured only
    mixed = [xs[4].double(), xs[2]]  # fp64 and a strided fp32 destination: each by itself, the same values
    h = c.to_halves(mixed, scales[:2], torch.empty(1017, dtype=torch.float16))
    assert torch.equal(h[:1000], codec.to_half(xs[4].double(), scales[0]))
    dst = [torch.empty(1000, dtype=torch.float64), torch.empty(17, 2)[:, 0]]
    c.from_halves(h, [1000, 17], scales[:2], dst)
    assert torch.equal(dst[0], h[:1000].double() / scales[0]) and torch.equal(dst[1], h[1000:].float() / scales[1])
    with pytest.raises(ValueError, match="contiguous fp16 tensor of 1017"):
        c.to_halves(mixed, scales[:2], torch.empty(1016, dtype=torch.float16))
    with pytest.raises(ValueError, match="1016 elements, not 1017"):
        c.from_halves(h, [1000, 16], scales[:2])
    with pytest.raises(ValueError, match="a tensor of each size"):
        c.from_halves(h, [1000, 17], scales[:2], [dst[0], torch.empty(16)])


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_feedback_argument_errors():
    x = torch.ones(8)
    key = codec.RngKey(0, 0, 0, 0)
    with pytest.raises(ValueError, match="needs residual_out"):
        codec.ternarize_pack(x, 1.0, key, residual=torch.zeros(8))
    with pytest.raises(ValueError, match="residual_out must be a contiguous torch.float32 tensor of 8"):
        codec.ternarize_pack(x, 1.0, key, residual_out=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual must be"):
        codec.moments(x, residual=torch.zeros(7))


def test_non_contiguous_input_equals_contiguous():
    x = torch.randn(64, 48)
    t = x.t()  # non-contiguous view
    assert not t.is_contiguous()
    key = codec.RngKey(1, 2, 3, 4)
    assert torch.equal(codec.ternarize_pack(t, 1.0, key), codec.ternarize_pack(t.contiguous(), 1.0, key))
    assert codec.moments(t) == codec.moments(t.contiguous())


# ---------------------------------------------------------------------------------------------
@given(
    n=st.integers(0, 3000),
    dtype=st.sampled_from(DTYPES),
    scale=st.floats(1e-6, 1e3),
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**32 - 1),
    rank=st.integers(0, 2**16 - 1),
    tid=st.integers(0, 2**32 - 1),
    data_seed=st.integers(0, 2**31),
)
def test_roundtrip_property(n, dtype, scale, seed, step, rank, tid, data_seed):
    g = torch.Generator().manual_seed(data_seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    xf = x.float()
    s = float(torch.tensor(scale * 2.0, dtype=torch.float32))
    key = codec.RngKey(seed, step, rank, tid)
    packed = codec.ternarize_pack(x, s, key, backend="cpu")
    assert packed.numel() == (n + 3) // 4
    assert torch.equal(packed, codec.ternarize_pack(x, s, key, backend="reference"))
    codes = reference.unpack(packed, ((n + 3) // 4) * 4)
    assert not bool((codes == 3).any()), "no encoder writes 0b11"
    assert not bool((codes[n:] != 0).any()), "padding codes are zero"
    dec = codec.decode_mean([packed], [s], True, n, backend="cpu")
    # every decoded value is 0 or +-s with the sign of x; |x| >= s always keeps
    vals = reference.values(codes[:n])
    assert torch.equal(dec, vals * torch.tensor(s, dtype=torch.float32))
    nz = vals != 0
    assert bool((torch.sign(xf[nz]) == vals[nz]).all())
    assert bool((vals[xf.abs() >= s] != 0).all())
    assert bool((vals[xf == 0] == 0).all())


# ---------------------------------------------------------------------------------------------
def test_unbiased_within_statistical_bound():
    """mean over K keys of s*b -> g; per element the error of the mean has std <= s / (2 sqrt(K)).

    The 16-bit uniform adds a deterministic bias of at most s * 2^-17 (docs/wire-format.md).
    """
    n, k = 4096, 2000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 0.3
    s = 1.0
    xc = x.clamp(-s, s)
    acc = torch.zeros(n, dtype=torch.float64)
    for step in range(k):
        packed = codec.ternarize_pack(x, s, codec.RngKey(7, step, 0, 1))
        acc += codec.decode_mean([packed], [s], True, n).double()
    mean = acc / k
    err = (mean - xc.double()).abs()
    sd = torch.sqrt(xc.double().abs() / s * (1 - xc.double().abs() / s)) * s / math.sqrt(k)
    bound = 5 * sd + s * 2.0**-17 + 1e-12  # 5 sigma per element: ~6e-7 false-alarm rate per element
    assert bool((err <= bound).all()), float((err - bound).max())
    # and overall: the mean error over all elements is ~0 (no systematic drift)
    assert abs(float((mean - xc.double()).mean())) < 4 * float(sd.pow(2).mean().sqrt()) / math.sqrt(n) + 2.0**-17


def test_clipping_gives_plus_minus_s():
    x = torch.tensor([5.0, -5.0, 1.0, -1.0, 1.0000001, -3.0, 0.5] * 50)
    s = 1.0
    for step in range(20):
        packed = codec.ternarize_pack(x, s, codec.RngKey(1, step, 0, 0))
        dec = codec.decode_mean([packed], [s], True, x.numel())
        big = x.abs() >= s
        assert torch.equal(dec[big], torch.sign(x[big]) * s)


@pytest.mark.parametrize("backend", backends())
def test_all_zero_tensor_gives_zero_codes_and_no_nan(backend):
    x = torch.zeros(1001, device=_dev(backend))
    st_ = codec.moments(x, backend=backend)
    assert st_ == codec.Moments(0.0, 0.0, 0.0, 0)
    packed = codec.ternarize_pack(x, 0.0, codec.RngKey(1, 1, 1, 1), backend=backend)
    assert int(packed.count_nonzero()) == 0
    dec = codec.decode_mean([packed, packed], [0.0, 0.0], True, 1001, backend=backend)
    assert bool(torch.isfinite(dec).all()) and int(dec.count_nonzero()) == 0


def test_stats_flags_non_finite_and_matches_torch():
    x = torch.randn(100_000, dtype=torch.float64)
    st_ = codec.moments(x)
    assert st_.mean == pytest.approx(float(x.mean()), abs=1e-12)
    assert st_.std == pytest.approx(float(x.std(unbiased=False)), rel=1e-10)
    assert st_.absmax == float(x.abs().max())
    x[5] = float("nan")
    x[7] = float("inf")
    assert codec.moments(x).nonfinite == 2
    assert codec.moments(x.float()).nonfinite == 2
    assert codec.moments(x.half()).nonfinite >= 2


def test_decode_rejects_invalid_codes(simd):
    bad = torch.tensor([0b11], dtype=torch.uint8)
    with pytest.raises(codec.CorruptPayload):
        codec.decode_mean([bad], [1.0], True, 4)
    big = torch.zeros(64, dtype=torch.uint8)  # 256 elements: the SIMD path
    big[17] = 0b00110000
    for shared in (True, False):
        with pytest.raises(codec.CorruptPayload):
            codec.decode_mean([big, big], [1.0, 1.0], shared, 256)
    pad = torch.tensor([0b01000000], dtype=torch.uint8)  # element 3 set, but n = 3
    with pytest.raises(codec.CorruptPayload):
        codec.decode_mean([pad], [1.0], True, 3)
    with pytest.raises(codec.CorruptPayload):
        codec.decode_mean([pad], [1.0], True, 3, backend="reference")


def test_argument_errors():
    with pytest.raises(ValueError, match="allowed: auto, cpu, cuda, reference"):
        codec.moments(torch.ones(3), backend="gpu")
    with pytest.raises(TypeError, match="floating-point"):
        codec.moments(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="rank"):
        codec.RngKey(0, 0, 70000, 0)
    with pytest.raises(ValueError, match="scaler"):
        codec.ternarize_pack(torch.ones(4), float("nan"), codec.RngKey(0, 0, 0, 0))


def test_cuda_source_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    src = Path(codec.__file__).with_name("terngrad_kernels.cu")
    res = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "--ptx", "-o", str(tmp_path / "k.ptx"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for kernel in ("tg_stats_partial", "tg_ternarize_pack", "tg_decode_sum"):
        assert kernel in ptx


def test_cuda_source_compiles_with_nvrtc_as_cupy_does_without_spills():
    """NVRTC (cupy-cuda12x's) with the options CuPy uses, for sm_80 and sm_90, cubin and PTX; then ptxas -v."""
    from benchmarks import kernel_resources as kr

    ptxas = shutil.which("ptxas")
    uses = kr.check(kr.Nvrtc(), ptxas)
    if ptxas is None:
        pytest.skip("NVRTC compiled every kernel; ptxas is not installed, so registers and spills are unread")
    kernels = {u.kernel for u in uses}
    assert {"tg_decode_sum", "tg_stats_partial_f32", "tg_ternarize_pack_bf16", "tg_sum_shards",
            "tg_ternarize_pack_blocks_f16", "tg_block_absmax_f64", "tg_ternarize_pack_feedback_f32"} <= kernels
    assert len(uses) == len(kr.ARCHS) * len(kernels) == 46  # 23 kernels
    assert [u for u in uses if u.spill_stores or u.spill_loads] == []


def test_nvrtc_check_fails_on_what_only_nvcc_accepts():
    """A host header compiles under nvcc but not under NVRTC: the check must say so, with NVRTC's log."""
    from benchmarks import kernel_resources as kr

    src = '#include <cstdio>\nextern "C" __global__ void k(int* x) { x[0] = 1; }\n'
    with pytest.raises(kr.CompileFailure, match="cstdio"):
        kr.Nvrtc().compile(src, "k.cu", kr.cupy_options("90", "cubin"), "cubin")


def test_codec_benchmark_smoke(tmp_path, capsys):
    """benchmarks/codec_bench.py at a small size: its tables come out at each SIMD level asked for, side by side,
    error feedback's and the fp16 wire's among them."""
    from benchmarks import codec_bench

    top = cpu.SIMD_LEVELS[cpu.set_simd_level(3)]
    codec_bench.main(["--sizes", "8192", "--threads", "1", "--simd", f"scalar,{top}", "--json",
                      str(tmp_path / "bench.json")])
    out = json.loads((tmp_path / "bench.json").read_text())
    assert cpu.SIMD_LEVELS[cpu.simd_level()] == top  # left as it was
    levels = ["scalar"] + ([top] if top != "scalar" else [])
    assert [r["simd"] for r in out["cpu"]] == levels and all(r["encode"] > 0 for r in out["cpu"])
    assert [r["simd"] for r in out["feedback_seconds"]] == levels
    fb = out["feedback_seconds"][0]
    assert all(fb[k] > 0 for k in ("encode_paper", "encode_recommended", "ternarize", "ternarize_feedback"))
    assert all(out["half_seconds"][0][k] > 0 for k in ("to_half", "to_half_torch", "from_half", "from_half_torch"))
    assert "EF cost" in capsys.readouterr().out


def _pass_digests(nthreads: int) -> list:
    """What the multi-threaded kernels give for one 2^20-element tensor (stats, codes, residual, decode)."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5)) * 0.01
    r = torch.randn(1 << 20, generator=torch.Generator().manual_seed(6)) * 0.001
    s, key = float(x.abs().max()), codec.RngKey(1, 2, 3, 4)
    codes = codec.ternarize_pack(x, s, key, residual=r, residual_out=r, backend="cpu", nthreads=nthreads)
    mean = codec.decode_mean([codes, codes], [s, s], True, x.numel(), backend="cpu", nthreads=nthreads)
    m = cpu.moments(x, nthreads)
    return [tuple(m), bytes(codes.numpy()), bytes(r.numpy()), bytes(mean.numpy())]


def test_the_codecs_threads_serve_concurrent_callers_and_a_forked_child():
    """The kernels' worker threads live between calls (csrc/terngrad_internal.h, Pool): callers on several
    threads at once get their own results (one holds the pool, the others spawn threads), and a child forked
    after the pool started, which has none of its threads, gets a pool of its own instead of waiting forever."""
    import concurrent.futures
    import os

    want = _pass_digests(1)
    assert _pass_digests(2) == want  # the pool is up
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert all(got == want for got in ex.map(lambda _: _pass_digests(2), range(8)))
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its threads gave the same bits
        torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork (its threads are the parent's)
        os._exit(0 if _pass_digests(2) == want else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the forked child's codec call did not return within 60 s")
