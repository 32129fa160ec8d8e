"""Block scalers (block_size=, wire format version 2): golden bytes, backends, the scaler rule, the pipeline's
records and every transport. Real multi-rank jobs with block scalers: tests/test_horovod.py and
tests/test_frontends.py."""
import json
import math
from pathlib import Path

import pytest
import torch

from hvd_terngrad import TernGradConfig, codec, wire
from hvd_terngrad.codec import cpu, reference
from hvd_terngrad.errors import NonFiniteGradientError, PayloadMismatchError
from hvd_terngrad.pipeline import apply_shared, scaler_vectors
from tests.golden.make_golden import block_case, block_record
from tests.loopback import exchange as loopback_exchange
from tests.loopback import pipelines
from tests.test_codec import DTYPES, backends, simd  # noqa: F401  (simd: a fixture)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "codec_v2.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("backend", backends())
def test_golden_vectors_v2(case, backend):
    x, scalers, block, key = block_case(case)
    dev = "cuda" if backend == "cuda" else "cpu"
    absmax = codec.block_absmax(x.to(dev), block, backend=backend)
    assert torch.equal(absmax.cpu(), reference.block_absmax(x, block))
    assert scalers.numpy().astype("<f4").tobytes().hex() == case["scalers_hex"]
    assert len(set(scalers.tolist())) > 1  # the case exercises several scalers
    packed = codec.ternarize_pack_blocks(x.to(dev), scalers.to(dev), block, key, backend=backend)
    assert bytes(packed.cpu().tolist()).hex() == case["packed_hex"]
    assert block_record(case, True).hex() == case["record_shared_hex"]
    assert block_record(case, False).hex() == case["record_own_hex"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 64), (63, 64), (64, 64), (1000, 256), (70_001, 4096), (300_001, 65536),
                                     (300_001, 64), (300_001, 1 << 17)])
def test_cpu_matches_reference_bit_for_bit(dtype, n, block, simd):  # noqa: F811
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * torch.linspace(1e-3, 1, n, dtype=torch.float64)).to(dtype)
    x[n // 2] = float("nan")  # ignored by the block maxima, never kept
    absmax = codec.block_absmax(x, block, backend="cpu")
    assert torch.equal(absmax, reference.block_absmax(x, block))
    for nt in (1, 3):  # with the statistics, from one pass
        st, fused = codec.moments_blocks(x, block, backend="cpu", nthreads=nt)
        assert torch.equal(fused, absmax) and repr(st) == repr(codec.moments(x, backend="cpu", nthreads=nt))
    scalers = (absmax * 0.7).float()
    key = codec.RngKey(2**40 + 3, 11, 5, 0xABCDEF01)
    a = codec.ternarize_pack_blocks(x, scalers, block, key, backend="cpu", nthreads=1)
    assert torch.equal(a, codec.ternarize_pack_blocks(x, scalers, block, key, backend="reference"))
    assert torch.equal(a, codec.ternarize_pack_blocks(x, scalers, block, key, backend="cpu", nthreads=3))
    other = codec.ternarize_pack_blocks(x.flip(0), scalers.flip(0), block, key, backend="cpu")
    rows = torch.stack([scalers, scalers.flip(0), scalers * 0.5])
    for shared in (True, False):
        s = rows[0] if shared else rows
        d1 = codec.decode_mean_blocks([a, other, a], s, shared, n, block, backend="cpu", nthreads=3)
        d2 = codec.decode_mean_blocks([a, other, a], s, shared, n, block, backend="reference")
        assert torch.equal(d1, d2)


def test_one_block_is_version_1():
    """A block as large as the tensor codes and decodes exactly as the per-tensor scaler does."""
    x = torch.randn(5000) * 0.1
    key = codec.RngKey(1, 2, 3, 4)
    one = torch.tensor([0.2], dtype=torch.float32)
    a = codec.ternarize_pack_blocks(x, one, 8192, key)
    assert torch.equal(a, codec.ternarize_pack(x, 0.2, key))
    assert torch.equal(codec.decode_mean_blocks([a, a], one, True, 5000, 8192),
                       codec.decode_mean([a, a], [0.2, 0.2], True, 5000))


def test_scaler_rule_keeps_the_papers_clipping_and_never_adds_variance():
    """s_b = min(c std, max_b|g|): an element is clipped exactly when the per-tensor scaler clips it, and every
    other element's variance |g| (s_b - |g|) is at most the per-tensor one."""
    g = torch.randn(10_000, dtype=torch.float64) * torch.linspace(0.01, 1, 10_000, dtype=torch.float64) ** 3
    g[7] = 40.0  # an outlier that c * std clips
    g = g.float()
    for clip in (2.5, 0.0):
        cfg = TernGradConfig(clip=clip, block_size=256)
        st = codec.moments(g)
        s = cfg.scaler(st)
        sb = reference.per_element(cfg.block_scalers(st, codec.block_absmax(g, 256)), 256, g.numel())
        a = g.abs()
        assert bool((sb <= s).all())
        assert torch.equal(a > sb, a > s)
        inside = a <= sb
        assert bool(((a * (sb - a))[inside] <= (a * (s - a))[inside]).all())
        gain = 0.9 if clip else 0.5  # clipping already cuts the variance that large values cause
        assert float((a * (sb - a))[inside].sum()) < gain * float((a * (s - a))[inside].sum())


def test_unbiased_within_statistical_bound():
    """Without clipping, the mean over K draws of the decoded block-coded tensor tends to g, block by block."""
    n, k, block = 2048, 1500, 64
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 1, n)
    cfg = TernGradConfig(clip=0.0, block_size=block)
    scalers = cfg.block_scalers(codec.moments(x), codec.block_absmax(x, block))
    s = reference.per_element(scalers, block, n).double()
    acc = torch.zeros(n, dtype=torch.float64)
    for step in range(k):
        packed = codec.ternarize_pack_blocks(x, scalers, block, codec.RngKey(7, step, 0, 1))
        acc += codec.decode_mean_blocks([packed], scalers, True, n, block).double()
    err = (acc / k - x.double()).abs()
    a = x.double().abs()
    bound = 5 * torch.sqrt(a * (s - a)) / math.sqrt(k) + s * 2.0**-17 + 1e-12
    assert bool((err <= bound).all()), float((err - bound).max())


def test_invalid_block_sizes_are_refused():
    for bad in (0, 32, 100, 3 * 64, True, 2**31, "256"):
        with pytest.raises(ValueError, match="block_size"):
            TernGradConfig(block_size=bad)
    with pytest.raises(ValueError, match="fp32 of shape"):
        codec.ternarize_pack_blocks(torch.ones(100), torch.ones(3), 64, codec.RngKey(0, 0, 0, 0))
    with pytest.raises(ValueError, match="finite"):
        codec.ternarize_pack_blocks(torch.ones(100), torch.tensor([1.0, float("nan")]), 64, codec.RngKey(0, 0, 0, 0))
    assert cpu.available()


def _exchange(n, grads, **options):
    """One step of n in-process ranks on one tensor each (allgather): the run, each rank's items, and the
    payloads every rank received."""
    run = loopback_exchange(n, [[("w", g)] for g in grads], **options)
    return run, [g.items for g in run.groups], run.received(0, "allgather")


@pytest.mark.parametrize("share", [True, False])
def test_records_follow_the_wire_format(share):
    """The allgather's version-2 record is header, block scalers unless shared, then the codes."""
    n, numel, block = 2, 1000, 64
    grads = [torch.randn(numel) * torch.linspace(0.01, 1, numel) * (r + 1) for r in range(n)]
    run, items, gathered = _exchange(n, grads, block_size=block, share_scaler=share, seed=5)
    size = wire.record_size(numel, block, share)
    assert gathered.numel() == n * size
    for r in range(n):
        rec = gathered[r * size: (r + 1) * size]
        magic, version, h = wire.parse_header(bytes(rec[:wire.HEADER_SIZE].tolist()))
        assert (magic, version, h.block_size, h.numel) == (wire.MAGIC, 2, block, numel)
        scalers = items[r][0].scalers
        off = wire.HEADER_SIZE
        if not share:
            assert torch.equal(rec[off: off + 4 * scalers.numel()].view(torch.float32), scalers)
            off += wire.block_scalers_size(numel, block)
        codes = codec.ternarize_pack_blocks(items[r][0].flat, scalers, block, run.pipes[r].coder.key(items[r][0]))
        assert torch.equal(rec[off: off + codes.numel()], codes)
    outs = [a[0] for a in run.averages]
    assert torch.equal(outs[0], outs[1])
    rows = torch.stack([it[0].scalers for it in items])
    codes = [codec.ternarize_pack_blocks(it[0].flat, it[0].scalers, block, p.coder.key(it[0]))
             for p, it in zip(run.pipes, items)]
    assert torch.equal(outs[0], codec.decode_mean_blocks(codes, rows[0] if share else rows, share, numel, block,
                                                         backend="reference"))


def test_ranks_with_other_block_sizes_are_a_clear_error():
    """A rank with another block_size (or none) is named; its scaler vector has another length."""
    g = [torch.randn(1000), torch.randn(1000)]
    pipes = pipelines(2, [TernGradConfig(block_size=64, share_scaler=False), TernGradConfig(share_scaler=False)])
    groups = [p.start("w", [("w", x)]) for p, x in zip(pipes, g)]
    for p, grp in zip(pipes, groups):
        with pytest.raises(PayloadMismatchError, match="block_size|version"):
            p.finish(grp)
    c, d = pipelines(2, [TernGradConfig(block_size=128), TernGradConfig(block_size=64)])
    ic, id_ = [c.coder.prepare("w", g[0])], [d.coder.prepare("w", g[1])]
    with pytest.raises(PayloadMismatchError, match="block_size"):
        apply_shared(id_, *scaler_vectors(ic, 128), 64, d.coder)


def test_shared_block_scalers_travel_at_16_bits_rounded_up():
    """Shared, each block scaler is the Max over ranks of the ranks' scalers rounded up to bfloat16 (so no code
    clips what it would not have clipped), carried at 2 bytes a block; unshared, the records keep fp32."""
    g = [torch.randn(1000) * 0.01, torch.randn(1000) * 0.02]
    cfg = TernGradConfig(block_size=64)
    run, items, _ = _exchange(2, g, block_size=64)
    exact = []
    for x in g:
        st, absmax = codec.moments_blocks(x, 64)
        exact.append(cfg.block_scalers(st, absmax))
    want = wire.round_block_scalers(torch.maximum(*exact))
    for r in range(2):
        got = items[r][0].scalers
        assert torch.equal(got, want) and bool((got >= torch.maximum(*exact)).all())
        assert bool((got <= torch.maximum(*exact) * (1 + 2**-7)).all())  # bfloat16: 8 significant bits
        assert run.pipes[r].coder.scaler_bytes(items[r][0]) == wire.SCALER_ENTRY_BYTES + 2 * 16
    _, own, _ = _exchange(2, g, block_size=64, share_scaler=False)
    assert torch.equal(own[0][0].scalers, exact[0])


def test_the_16_bit_carrier_keeps_the_order_of_the_scalers():
    """The fp16 Max over the carried patterns is the Max of the rounded scalers, across the whole range."""
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.rand(2, 20_000, generator=gen) * torch.exp2(torch.randint(-140, 121, (2, 20_000), generator=gen)
                                                             .float())).clamp(max=2.0**121 * (1 - 2**-20))
    x[:5] = 0.0
    rx, ry = wire.round_block_scalers(x), wire.round_block_scalers(y)
    assert bool((rx >= x).all()) and bool((rx[x > 0] >= 2.0**-119).all()) and bool((rx[:5] == 0).all())
    m = torch.maximum(wire.block_scalers_carrier(rx), wire.block_scalers_carrier(ry))
    assert bool(torch.isfinite(m).all())
    assert torch.equal(wire.block_scalers_from_carrier(m), torch.maximum(rx, ry))


def test_a_gradient_beyond_the_block_scalers_range_is_reported():
    """A value of 2^121 or more cannot have a shared 16-bit block scaler: reported as a non-finite one is."""
    g = [torch.randn(1000), torch.randn(1000)]
    g[0][3] = 2.0**122
    run, _, _ = _exchange(2, g, block_size=64)
    for p, grp in zip(run.pipes, run.groups):
        assert p.nonfinite(grp)[0].nonfinite_rank == 0
    with pytest.raises(NonFiniteGradientError, match="2\\^121"):
        run.pipes[0].coder.raise_nonfinite(run.groups[0].items)


def test_corrupt_block_scalers_are_refused():
    run, items, gathered = _exchange(2, [torch.randn(1000), torch.randn(1000)], block_size=64,
                                     share_scaler=False)
    bad = gathered.clone()
    size = wire.record_size(1000, 64, False)
    bad[size + wire.HEADER_SIZE: size + wire.HEADER_SIZE + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(PayloadMismatchError, match="rank 1 holds a block scaler"):
        run.decode(0, bad)


def test_a_nan_on_one_rank_is_reported_with_block_scalers():
    g = [torch.randn(1000), torch.randn(1000)]
    g[1][5] = float("nan")
    run, _, _ = _exchange(2, g, block_size=64)
    for p, grp in zip(run.pipes, run.groups):
        assert p.nonfinite(grp)[0].nonfinite_rank == 1


def test_block_scalers_benchmark_smoke():
    """benchmarks/block_scalers.py on the digits CNN, 2 workers: per-tensor clipping keeps one worker's bias
    (shared, a block's Max may clip a little more) and lowers the error; the table and the timing come out."""
    from benchmarks import block_scalers as bs

    rows = bs.error_table(["digits"], 2, [64])
    get = {(r["workers"], r["rule"], r["block"]): r for r in rows}
    for n in (1, 2):
        paper, ours = get[(n, "tensor-clip", None)], get[(n, "tensor-clip", 64)]
        assert ours["bias2"] == pytest.approx(paper["bias2"], rel=1e-9 if n == 1 else 0.05)
        assert ours["error"] < paper["error"]
        assert get[(n, "noclip", 64)]["bias2"] == 0
        assert get[(n, "noclip", 64)]["error"] < get[(n, "noclip", None)]["error"]
    times = bs.encode_times([64], n=1 << 16, repeats=1)
    assert {(r["threads"], r["block"]) for r in times} == {(1, None), (1, 64), (2, None), (2, 64)}
    assert "| digits | 2 | tensor-clip |" in bs.markdown(rows, times, 2, [64])


def test_the_recommended_configuration():
    cfg = TernGradConfig.recommended(seed=3)
    assert (cfg.clip, cfg.error_feedback, cfg.block_size, cfg.seed) == (0.0, True, 64, 3)
    assert TernGradConfig.recommended(block_size=256).block_size == 256
