"""The sharded transport: codes to shard owners (alltoall), b-bit sums back (allgather), the allgather's bits."""
import pytest
import torch

from hvd_terngrad import TernGradConfig, TernGradEngine, codec, wire
from hvd_terngrad.codec import reference
from tests.mpi_harness import run_ranks


@pytest.mark.parametrize("nranks,bits", [(2, 4), (7, 4), (8, 8), (127, 8), (128, 16), (32767, 16)])
def test_sum_width_follows_the_worker_count(nranks, bits):
    assert wire.sum_bits(nranks) == bits
    assert wire.sums_size(10, nranks) == 10 * bits // 2


def test_sum_width_has_a_limit():
    with pytest.raises(ValueError, match="32767"):
        wire.sum_bits(32768)


@pytest.mark.parametrize("nranks", [2, 3, 7, 8, 100, 127, 128, 300])
def test_owner_sums_pack_unpack_and_decode_like_the_allgather(nranks):
    g = torch.Generator().manual_seed(nranks)
    shard = 37  # bytes per rank: 148 codes
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


def test_an_invalid_code_in_a_shard_is_refused():
    bad = torch.full((2, 3), 0xFF, dtype=torch.uint8)
    with pytest.raises(codec.CorruptPayload):
        codec.sum_code_shards(bad, 2)


def _bucket(rank: int):
    g = torch.Generator().manual_seed(rank)
    return {"a.weight": torch.randn(33, 7, generator=g), "b.weight": torch.randn(1001, generator=g),
            "c.weight": torch.randn(5, generator=g)}


@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_engines_in_one_process_give_the_allgathers_bits(nranks):
    """N engines, the alltoall and the allgather done by slicing: the decode equals the allgather decode."""
    cfg = TernGradConfig(seed=5, min_numel=1)
    engines = [TernGradEngine(cfg, r, nranks) for r in range(nranks)]
    items = [[e.prepare(n, t) for n, t in _bucket(r).items()] for r, e in enumerate(engines)]
    vecs = torch.stack([e.scaler_vector(it) for e, it in zip(engines, items)]).max(dim=0).values
    for e, it in zip(engines, items):
        e.apply_shared(it, vecs)
    gathered = torch.cat([e.encode(it) for e, it in zip(engines, items)])
    want = engines[0].decode(items[0], gathered)
    streams = [e.encode_stream(it) for e, it in zip(engines, items)]
    shard = streams[0].numel() // nranks
    owned = [torch.stack([s[j * shard:(j + 1) * shard] for s in streams]) for j in range(nranks)]
    sums = torch.cat([codec.sum_code_shards(o, nranks) for o in owned])
    for e, it in zip(engines, items):
        got = e.decode_packed_sums(it, sums)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(Exception, match="code sums"):
        engines[0].decode_packed_sums(items[0], sums[:-1])


def test_sharded_needs_a_shared_scaler():
    with pytest.raises(ValueError, match="share_scaler=True"):
        TernGradConfig(transport="sharded", share_scaler=False)


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 4, 8])
def test_sharded_averages_are_bit_identical_to_the_allgathers_on_real_ranks(np):
    runs = {}
    fronts = [("hvd_terngrad", "allgather"), ("hvd_terngrad", "sharded"), ("stock", "sharded")]
    for front, transport in fronts if np < 8 else fronts[:2]:
        res = run_ranks("tests.test_horovod:body_train", np=np, timeout=240, args=(front, {"transport": transport}, 3))
        assert all(torch.equal(r["params"], res[0]["params"]) for r in res)
        runs[(front, transport)] = res[0]
    ref = runs[("hvd_terngrad", "allgather")]["params"]
    for key, r in runs.items():
        assert torch.equal(r["params"], ref), key
    gather, sharded = runs[("hvd_terngrad", "allgather")]["stats"], runs[("hvd_terngrad", "sharded")]["stats"]
    assert sharded["dense_bytes"] == gather["dense_bytes"]
    if np >= 4:  # the codes go to one owner each instead of to every rank
        assert sharded["bytes_received"] < gather["bytes_received"]
