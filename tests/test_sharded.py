"""The sharded transports: codes to shard owners (alltoall), b-bit sums or owner codes back (allgather)."""
import json
from pathlib import Path

import pytest
import torch

from hvd_terngrad import TernGradConfig, codec, wire
from hvd_terngrad.codec import reference
from hvd_terngrad.transports import TRANSPORTS
from tests.golden.make_golden import golden_input
from tests.loopback import exchange
from tests.test_codec import simd  # noqa: F401  (a fixture: every SIMD path)


@pytest.mark.parametrize("nranks,bits", [(2, 4), (7, 4), (8, 8), (127, 8), (128, 16), (32767, 16)])
def test_sum_width_follows_the_worker_count(nranks, bits):
    assert wire.sum_bits(nranks) == bits
    assert wire.sums_size(10, nranks) == 10 * bits // 2


def test_sum_width_has_a_limit():
    with pytest.raises(ValueError, match="32767"):
        wire.sum_bits(32768)


@pytest.mark.parametrize("nranks", [2, 3, 7, 8, 100, 127, 128, 300])
@pytest.mark.parametrize("shard", [37, 2100])  # bytes per rank: SIMD groups of 16 and a tail; several blocks
def test_owner_sums_pack_unpack_and_decode_like_the_allgather(nranks, shard, simd):  # noqa: F811
    g = torch.Generator().manual_seed(nranks)
    codes = [reference.pack(torch.randint(0, 3, (4 * shard,), generator=g, dtype=torch.uint8))
             for _ in range(nranks)]
    packed = codec.sum_code_shards(torch.stack(codes), nranks)  # the C++ kernel
    assert packed.numel() == wire.sums_size(shard, nranks)
    assert torch.equal(packed, codec.sum_code_shards(torch.stack(codes), nranks, backend="reference"))
    sums, ok = reference.sum_shards(torch.stack(codes))
    assert ok and torch.equal(reference.unpack_sums(packed, nranks), sums)
    assert int(sums.abs().max()) <= nranks
    whole = codec.decode_packed_sums(packed, nranks, 0, 4 * shard, 0.37)
    assert torch.equal(whole, codec.decode_packed_sums(packed, nranks, 0, 4 * shard, 0.37, backend="reference"))
    assert torch.equal(whole, codec.decode_mean(codes, [0.37] * nranks, True, 4 * shard, backend="reference"))
    for start, n in [(4, 101), (8, 1), (4 * shard - 4, 3)]:  # tensors start on whole bytes of codes
        for backend in ("cpu", "reference"):
            got = codec.decode_packed_sums(packed, nranks, start, n, 0.37, backend=backend)
            assert torch.equal(got, whole[start:start + n])


def test_an_invalid_code_in_a_shard_is_refused(simd):  # noqa: F811
    for shard in (3, 40):  # the tail, and a whole SIMD group
        bad = torch.zeros((2, shard), dtype=torch.uint8)
        bad[1, shard // 2] = 0b00110000  # one 0b11 code among valid ones
        with pytest.raises(codec.CorruptPayload):
            codec.sum_code_shards(bad, 2)


def _bucket(rank: int):
    g = torch.Generator().manual_seed(rank)
    return {"a.weight": torch.randn(33, 7, generator=g), "b.weight": torch.randn(1001, generator=g),
            "c.weight": torch.randn(5, generator=g)}


def _named(nranks: int):
    return [list(_bucket(r).items()) for r in range(nranks)]


@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_in_process_ranks_give_the_allgathers_bits(nranks):
    """N in-process ranks (loopback collectives): the sharded decode equals the allgather decode."""
    want = exchange(nranks, _named(nranks), seed=5, min_numel=1).averages
    run = exchange(nranks, _named(nranks), seed=5, min_numel=1, transport="sharded")
    for got in run.averages:
        assert all(torch.equal(a, b) for a, b in zip(got, want[0]))
    with pytest.raises(Exception, match="code sums"):
        run.decode(0, run.received(0, "allgather")[:-1])


def test_sharded_needs_a_shared_scaler():
    with pytest.raises(ValueError, match="share_scaler=True"):
        TernGradConfig(transport="sharded", share_scaler=False)


@pytest.mark.parametrize("nranks", [4, 8])
@pytest.mark.parametrize("transport", ["sharded", "sharded-ternary"])
def test_sharded_transports_move_less_than_the_allgather(transport, nranks):
    """Each code goes to one owner instead of to every rank: from 4 ranks on, a rank receives fewer bytes. (The
    real jobs of both front ends, every transport, are held to golden parameters in test_frontends.py.)"""
    def received(t):
        run = exchange(nranks, _named(nranks), seed=5, min_numel=1, transport=t)
        for p in run.pipes:
            p.next_step()
        return [p.stats.last for p in run.pipes]

    gather, sharded = received("allgather"), received(transport)
    for a, b in zip(gather, sharded):
        assert a.dense_bytes == b.dense_bytes and b.bytes_received < a.bytes_received


# ---------------------------------------------------------------------------------------------
# sharded-ternary: the owners draw again
def _owner_draws(nranks: int, steps: int, owner_error_feedback: bool = False, **options):
    """The workers' codes of one step stay; the owners draw afresh at each of `steps` steps (each with its
    kept error under owner_error_feedback). Yields rank 0's decoded result per step, after the workers' exact
    average (the allgather's decode of the same codes)."""
    exact = exchange(nranks, _named(nranks), min_numel=1, **options).averages[0]
    yield exact
    run = exchange(nranks, _named(nranks), min_numel=1, transport="sharded-ternary", key="bucket.0",
                   owner_error_feedback=owner_error_feedback, **options)
    t = TRANSPORTS["sharded-ternary"]
    for step in range(steps):
        replies = []
        for p, g in zip(run.pipes, run.groups):
            p.coder.step = step
            replies.append(t.owner_reply(run.received(p.rank, "alltoall").view(nranks, -1), g.handle.plan,
                                         "bucket.0"))
        yield run.decode(0, torch.cat(replies))


@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_sharded_ternary_every_rank_decodes_the_same_owner_codes(nranks):
    run = exchange(nranks, _named(nranks), seed=5, min_numel=1, transport="sharded-ternary")
    results = run.averages
    assert all(torch.equal(a, b) for res in results for a, b in zip(res, results[0]))
    shard = run.groups[0].handle.plan.stream.numel() // nranks
    assert run.received(0, "allgather").numel() == nranks * (shard + wire.OWNER_SCALER_BYTES)
    for res, it in zip(results[0], run.groups[0].items):  # each element is an owner's scaler times -1, 0 or +1
        assert res.shape == (it.numel,) and torch.isfinite(res).all()


def test_sharded_ternary_is_unbiased_given_the_workers_codes():
    """Owners' draws over 400 steps: their mean approaches the average of the workers' ternary gradients."""
    draws = 400
    results = _owner_draws(4, draws, seed=2, clip=0.0, owner_clip=0.0)
    exact = next(results)
    acc = [torch.zeros_like(x, dtype=torch.float64) for x in exact]
    top = 0.0
    for got in results:
        for a, g in zip(acc, got):
            a += g.double()
        top = max(top, max(float(g.abs().max()) for g in got))
    for a, x in zip(acc, exact):
        # an owner's draw has variance |x| (s' - |x|) <= s'^2 / 4: allow 5 standard errors of the mean
        assert float((a / draws - x.double()).abs().max()) <= 5 * top / 2 / draws ** 0.5


SHARDED_GOLDEN = json.loads((Path(__file__).parent / "golden" / "sharded_v1.json").read_text())


@pytest.mark.parametrize("case", SHARDED_GOLDEN["cases"], ids=lambda c: f"N{c['nranks']}")
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sharded_golden_vectors(case, backend):
    """The C++ kernels and the reference write the pinned bytes of section 10 for 4-, 8- and 16-bit sums."""
    n, shard = case["nranks"], case["shard_bytes"]
    streams = []
    for r in range(n):
        parts = [codec.ternarize_pack(golden_input(k, "float32"), SHARDED_GOLDEN["scaler"],
                                      codec.RngKey(SHARDED_GOLDEN["seed"], SHARDED_GOLDEN["step"], r, 100 + t),
                                      backend=backend) for t, k in enumerate(SHARDED_GOLDEN["numels"])]
        stream = torch.cat(parts)
        streams.append(torch.cat([stream, stream.new_zeros((-stream.numel()) % n)]))
    sums = torch.cat([codec.sum_code_shards(torch.stack([s[j * shard:(j + 1) * shard] for s in streams]), n,
                                            backend=backend) for j in range(n)])
    assert bytes(sums.tolist()).hex() == case["sums_hex"]
    off = 0
    for k in SHARDED_GOLDEN["numels"]:  # each tensor decodes to the allgather's bits
        want = codec.decode_mean([s[off: off + (k + 3) // 4].contiguous() for s in streams], [0.5] * n, True, k,
                                 backend="reference")
        assert torch.equal(codec.decode_packed_sums(sums, n, 4 * off, k, 0.5, backend=backend), want)
        off += (k + 3) // 4


def _owner_error_after(steps: int, feedback: bool) -> float:
    """|sum over steps of the decoded result - steps * the workers' average|, largest element, 4 ranks."""
    results = _owner_draws(4, steps, owner_error_feedback=feedback, seed=2)
    exact = next(results)
    total = [torch.zeros_like(x, dtype=torch.float64) for x in exact]
    for got in results:
        for acc, g in zip(total, got):
            acc += g.double()
    return max(float((acc - steps * x.double()).abs().max()) for acc, x in zip(total, exact))


def test_owner_error_feedback_keeps_the_accumulated_error_bounded():
    """With the owners' error kept, the sum of 60 results stays within a draw of 60 averages (clipping included);
    without it the error of the sum grows like the square root of the steps."""
    with_ef, without = _owner_error_after(60, True), _owner_error_after(60, False)
    assert with_ef < without / 3
    assert _owner_error_after(60, True) < 2 * _owner_error_after(5, True) + 1e-6  # bounded, not growing


def test_owner_error_feedback_is_for_sharded_ternary_only():
    with pytest.raises(ValueError, match="owner_error_feedback"):
        TernGradConfig(owner_error_feedback=True)
