"""Hardening: a lost rank, gradients of every shape and dtype, fuzzing of the codec and the records."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_terngrad import TernGradConfig, codec, wire
from hvd_terngrad.codec import reference
from hvd_terngrad.coder import Coder
from hvd_terngrad.transports import TRANSPORTS
from tests.mpi_harness import run_ranks, run_ranks_failing

FUZZ_CASES = 10_000


# ---------------------------------------------------------------------------------------------
def body_killed_rank(front):
    import os
    import signal

    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    if front == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=hvd_terngrad.TernGrad(named))
    else:
        opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named)
    for step in range(100_000):
        if step == 20 and hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    return "survived"


@pytest.mark.mpi
@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
def test_sigkilled_rank_ends_the_job_within_60s(front):
    msg = run_ranks_failing("tests.test_hardening:body_killed_rank", np=3, within=60, args=(front,))
    assert "signal 9" in msg or "Killed" in msg, msg[-2000:]


# ---------------------------------------------------------------------------------------------
def body_int8_peer_never_joins():
    import time as _time

    import horovod.torch as hvd

    from hvd_terngrad.collectives.horovod import HorovodCollectives

    hvd.init()
    t = HorovodCollectives(timeout_s=3.0)
    t._int8_comm()  # collective: every rank makes the communicator on its first sum
    if hvd.rank() == 0:
        h = t.int8_sum_async_(torch.ones(1000, dtype=torch.int8), name="x")
        t.wait(h, "the int8 code-sum allreduce of bucket 0 ('fc.weight', ...)")
        return "returned"
    _time.sleep(120)  # never joins
    return "slept"


@pytest.mark.mpi
def test_int8_sum_that_never_completes_aborts_the_job_with_a_clear_error():
    msg = run_ranks_failing("tests.test_hardening:body_int8_peer_never_joins", np=2, within=60)
    assert ("rank 0 waited 3 s for the int8 code-sum allreduce of bucket 0 ('fc.weight', ...)" in msg
            and "Aborting the job" in msg), msg[-3000:]


# ---------------------------------------------------------------------------------------------
def body_shapes_and_dtypes():
    """Parameters of many shapes and dtypes; the averaged gradient equals the reference decode."""
    import horovod.torch as hvd

    import hvd_terngrad
    from hvd_terngrad.config import tensor_id

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shapes = {"empty": ((0,), torch.float32), "one": ((1,), torch.float32), "half": ((300,), torch.float16),
              "bf16": ((257,), torch.bfloat16), "f64": ((129,), torch.float64), "mat": ((33, 17), torch.float32),
              "zeros": ((64,), torch.float32)}
    params = {n: torch.nn.Parameter(torch.zeros(s, dtype=dt)) for n, (s, dt) in shapes.items()}
    named = list(params.items())
    tg = hvd_terngrad.TernGrad(min_numel=1, seed=4)
    opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.1), named_parameters=named,
                                            compression=tg)
    g = torch.Generator().manual_seed(rank)
    grads = {}
    for n, p in named:
        if n == "mat":  # a non-contiguous gradient
            grads[n] = torch.randn(17, 33, generator=g).t()
        elif n == "zeros":
            grads[n] = torch.zeros(p.shape)
        else:
            grads[n] = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        p.grad = grads[n].to(p.dtype).clone()  # the optimizer averages p.grad in place
    opt.synchronize()
    out = {}
    for n, p in named:
        flat = grads[n].to(p.dtype).reshape(-1)
        if flat.numel() == 0:
            out[n] = p.grad.numel() == 0
            continue
        s = tg.pipeline.coder.scalers_used[n]
        codes = reference.ternarize_pack(flat, s, 4, 0, rank, tensor_id(n))
        allc = hvd.allgather(codes[None], name=f"c.{n}")
        exp, ok = reference.decode_mean(list(allc), [s] * size, True, flat.numel())
        out[n] = ok and torch.equal(p.grad.reshape(-1), exp.to(p.dtype)) and p.grad.dtype == p.dtype
        if n == "zeros":
            out[n] = out[n] and int(p.grad.count_nonzero()) == 0 and bool(torch.isfinite(p.grad).all())
    return out


@pytest.mark.mpi
def test_every_shape_and_dtype_through_horovod():
    res = run_ranks("tests.test_hardening:body_shapes_and_dtypes", np=2, timeout=120)
    for r in res:
        assert all(r.values()), r


# ---------------------------------------------------------------------------------------------
special = st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38, 1.0, -1.0, 0.5])


@settings(max_examples=FUZZ_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(0, 200),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    values=st.lists(st.one_of(st.floats(-4, 4, width=32), special), min_size=0, max_size=8),
    scaler=st.one_of(st.just(0.0), st.floats(float(np.float32(1e-30)), float(np.float32(1e30)), width=32)),
    key=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**16 - 1),
                  st.integers(0, 2**32 - 1)),
    nranks=st.integers(1, 4),
    shared=st.booleans(),
    corrupt=st.integers(-1, 60),
)
def test_fuzz_pack_unpack_decode(n, dtype, values, scaler, key, nranks, shared, corrupt):
    """10k cases: CPU bytes equal the reference; decode equals the reference; corruption is caught."""
    base = torch.tensor(values * (n // max(len(values), 1) + 1) if values else [0.0] * n, dtype=torch.float64)[:n]
    x = base.to(dtype)
    k = codec.RngKey(*key)
    packed = codec.ternarize_pack(x, scaler, k, backend="cpu")
    assert torch.equal(packed, codec.ternarize_pack(x, scaler, k, backend="reference"))
    if n == 0:
        return
    scalers = [scaler] * nranks if shared else [scaler * (r + 1) / nranks for r in range(nranks)]
    codes = [packed] + [codec.ternarize_pack(x, scalers[r], codec.RngKey(key[0], key[1], r, key[3]))
                        for r in range(1, nranks)]
    got = codec.decode_mean(codes, scalers, shared, n, backend="cpu")
    exp, ok = reference.decode_mean(codes, scalers, shared, n)
    assert ok and torch.equal(got, exp)
    if 0 <= corrupt < packed.numel() * 4:
        bad = packed.clone()
        byte, slot = divmod(corrupt, 4)
        bad[byte] |= 3 << (2 * slot)  # an invalid code, or a non-zero padding code
        with pytest.raises(codec.CorruptPayload):
            codec.decode_mean([bad], [scaler], True, n, backend="cpu")


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=0, max_size=200))
def test_fuzz_random_bytes_never_decode_silently(data):
    """Arbitrary bytes as a gathered payload: a clear PayloadMismatch, never a silent result."""
    coder = Coder(TernGradConfig(min_numel=1), 0, 2)
    item = coder.prepare("w", torch.randn(40))
    gathered = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    with pytest.raises(wire.PayloadMismatch):
        TRANSPORTS["allgather"].decode(coder, [item], gathered)


# ---------------------------------------------------------------------------------------------
def body_soak(steps, front):
    import horovod.torch as hvd

    from benchmarks.soak import soak

    hvd.init()
    torch.set_num_threads(1)
    return soak(steps, front, warmup=300)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("front", ["hvd_terngrad", "stock"])
def test_long_run_does_not_leak(front):
    """3000 steps on 2 ranks: RSS grows by less than 512 bytes a step after warm-up (a leaked gradient-sized
    buffer would be ~150 KB a step). benchmarks/soak.py runs 10k steps and prints the table."""
    res = run_ranks("tests.test_hardening:body_soak", np=2, timeout=300, args=(3000, front))
    for r in res:
        assert r["growth_per_step"] < 512, r
        assert r["history_len"] <= 1000  # the stats window is bounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_non_finite_check_finds_nan_and_inf_and_not_finite_values_whose_sum_overflows(dtype):
    """finite.nonfinite sums first: a finite sum clears a tensor; a sum beyond fp32's range is read again."""
    from hvd_terngrad.finite import nonfinite

    big = torch.finfo(dtype).max
    ok = [torch.zeros(0, dtype=dtype), torch.randn(1000).to(dtype), torch.full((64,), big, dtype=dtype),
          torch.tensor([big, -big, big], dtype=dtype)]
    bad = []
    for v in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(300).to(dtype)
        t[137] = v
        bad.append(t)
    both = torch.full((8,), big, dtype=dtype)
    both[3] = float("nan")
    assert nonfinite(ok + bad + [both]) == [4, 5, 6, 7]


def test_a_marked_sum_tells_every_rank_whose_tensor_was_non_finite():
    """finite.mark before a Sum allreduce (here summed by hand over 4 ranks): +Inf at each such rank's element."""
    from hvd_terngrad.finite import mark, marked_rank, nonfinite

    g = torch.Generator().manual_seed(0)
    ranks = [[torch.randn(50, generator=g), torch.randn(2, generator=g), torch.randn(30, generator=g)]
             for _ in range(4)]
    ranks[1][0][7] = float("nan")
    ranks[3][0][0] = float("-inf")
    ranks[2][1][1] = float("nan")  # 2 elements: too small to carry rank 2's marker
    for r, tensors in enumerate(ranks):
        if nonfinite(tensors):
            mark(tensors, r)
    sums = [sum(t[i] for t in ranks) for i in range(3)]
    assert nonfinite(sums) == [0, 1]
    assert [marked_rank(s, 4) for s in sums[:2]] == [1, -1]
    assert torch.isposinf(sums[0][[1, 3]]).all() and torch.isfinite(sums[0][[0, 2]]).all()
    assert torch.isfinite(sums[0][4:]).all()


@pytest.mark.parametrize("size", [2, 3, 8])
def test_where_no_rank_sends_beyond_the_limit_the_marker_positions_tell_a_non_finite_average(size):
    """The DDP hook's own fp32 average checks only finite.marker_positions: with every rank's values within
    ddp.averages.sendable(size), or marked, a sum (here in every rank order) is non-finite exactly where a rank marked a
    tensor, and its marker positions show it, values at the limit and tensors smaller than the world included."""
    from hvd_terngrad.ddp.averages import sendable as _sendable
    from hvd_terngrad.finite import absmax, mark, marker_positions, nonfinite

    limit, g = _sendable(size), torch.Generator().manual_seed(size)
    for trial in range(40):
        numels = [int(n) for n in torch.randint(1, 400, (5,), generator=g)] + [1]
        offsets = [(sum(numels[:i]), n) for i, n in enumerate(numels)]
        where = marker_positions(offsets, size)
        bufs, marked = [], set()
        for r in range(size):
            buf = (torch.rand(sum(numels), generator=g) * 2 - 1) * limit  # as far as a rank may send
            buf[offsets[2][0] + offsets[2][1] - 1] = limit  # the limit itself, in the same place on every rank
            if trial % 3 == 0 and r == trial % size:  # a NaN, an Inf or a finite value beyond the limit
                at = int(torch.randint(0, buf.numel(), (1,), generator=g))
                buf[at] = (math.nan, math.inf, 1.01 * limit)[trial % 9 // 3]
            views = [buf[o: o + n] for o, n in offsets]
            if not absmax(buf) <= limit:
                marked |= set(mark(views, r, limit))
            bufs.append(buf)
        for order in (range(size), reversed(range(size))):
            total = torch.zeros(sum(numels))
            for r in order:
                total += bufs[r]
            bad = nonfinite([total[o: o + n] for o, n in offsets])
            assert set(bad) == marked
            assert bool(nonfinite([total if where is None else total[where]])) == bool(marked)
