"""Options are validated with messages that name the allowed values; records round-trip and are checked."""
import struct

import pytest
import torch

from hvd_terngrad import TernGradConfig, codec, wire
from hvd_terngrad.coder import Coder
from hvd_terngrad.config import payload_tag
from tests.loopback import exchange


@pytest.mark.parametrize("kwargs,match", [
    ({"clip": -1.0}, "clip must be a finite number >= 0"),
    ({"clip": float("nan")}, "clip"),
    ({"min_numel": -5}, "min_numel must be an integer >= 0"),
    ({"backend": "tpu"}, "allowed: auto, cpu, cuda, reference"),
    ({"transport": "carrier-pigeon"}, "allowed: allgather"),
    ({"on_nonfinite": "ignore"}, "allowed: raise, skip"),
    ({"seed": -1}, "seed"),
    ({"num_threads": 0}, "num_threads"),
    ({"exclude": (3,)}, "exclude"),
    ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0"),
    ({"timeout_s": float("inf")}, "timeout_s"),
])
def test_invalid_options_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TernGradConfig(**kwargs)


def test_policy_and_scaler_rule():
    cfg = TernGradConfig(min_numel=10, exclude=("fc2.*",))
    assert cfg.compresses("fc1.weight", 100)
    assert not cfg.compresses("fc1.bias", 9)
    assert not cfg.compresses("fc2.weight", 100)
    st = codec.Moments(mean=0.0, std=1.0, absmax=10.0, nonfinite=0)
    assert cfg.scaler(st) == 2.5
    assert TernGradConfig(clip=0).scaler(st) == 10.0
    assert cfg.scaler(codec.Moments(0.0, 1.0, 2.0, 0)) == 2.0  # max|g| < c * std: the smaller one
    assert cfg.scaler(codec.Moments(0.5, 0.0, 0.5, 0)) == 0.5  # constant tensor: coded exactly


def test_record_header_layout():
    h = wire.Header(flags=wire.FLAG_SHARED, tag=0xDEADBEEF, numel=13, scaler=0.5, step=7)
    raw = h.pack()
    assert len(raw) == wire.HEADER_SIZE == 24
    assert raw[:3] == b"TG\x01" and raw[3] == 1
    assert struct.unpack("<IQfI", raw[4:]) == (0xDEADBEEF, 13, 0.5, 7)
    assert wire.record_size(13) == 24 + 8 and wire.record_size(32) == 32 and wire.record_size(33) == 24 + 16


def _roundtrip(size, grads, share=True):
    """One group of tensors through `size` in-process ranks (allgather)."""
    return exchange(size, [[(f"t{i}", g[r]) for i, g in enumerate(grads)] for r in range(size)], min_numel=1,
                    share_scaler=share, seed=3)


def test_decode_without_horovod():
    run = _roundtrip(2, [torch.randn(2, 1000), torch.randn(2, 37)])
    outs = run.averages
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert outs[0][0].shape == (1000,)


def test_decode_detects_other_tensor_step_and_corruption():
    run = _roundtrip(2, [torch.randn(2, 1000)])
    gathered = run.received(0, "allgather")
    bad = gathered.clone()
    rec = wire.record_size(1000)
    bad[rec + 4] ^= 1  # rank 1's tag
    with pytest.raises(wire.PayloadMismatch, match="from rank 1 .*another tensor"):
        run.decode(0, bad)
    run.pipes[0].coder.step = 5
    with pytest.raises(wire.PayloadMismatch, match="out of step"):
        run.decode(0, gathered)
    run.pipes[0].coder.step = 0
    bad = gathered.clone()
    bad[wire.HEADER_SIZE] = 0xFF  # invalid codes
    with pytest.raises(wire.PayloadMismatch, match="invalid ternary codes"):
        run.decode(0, bad)
    with pytest.raises(wire.PayloadMismatch, match="disagree"):
        run.decode(0, gathered[:-8])


def test_tags_differ_by_name_shape_dtype():
    base = payload_tag("w", (4, 4), torch.float32)
    assert base != payload_tag("v", (4, 4), torch.float32)
    assert base != payload_tag("w", (16,), torch.float32)
    assert base != payload_tag("w", (4, 4), torch.float16)


def test_integer_and_complex_gradients_are_rejected_with_name_and_rank():
    e = Coder(TernGradConfig(), 3, 4)
    with pytest.raises(TypeError, match="'emb' on rank 3 has dtype torch.int64"):
        e.prepare("emb", torch.ones(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="complex64"):
        e.prepare("z", torch.ones(5, dtype=torch.complex64))


def test_summed_transport_needs_a_shared_scaler():
    with pytest.raises(ValueError, match="share_scaler=True"):
        TernGradConfig(transport="summed", share_scaler=False)


def test_commcost_crossovers():
    from hvd_terngrad import transports

    big = 10_000_000
    assert transports.choose_transport(big, 3) == "allgather"
    assert transports.choose_transport(big, 4) == transports.choose_transport(big, 64) == "sharded"
    assert 16 <= transports.crossover_nodes(big) <= 18  # summed against allgather, bandwidth terms alone: N = 16
    assert 8 <= transports.crossover_nodes(big, summed="summed-int8") <= 10
    assert transports.choose_transport(1000, 64) == "allgather"  # small buckets: latency decides


@pytest.mark.parametrize("transport", ["summed", "summed-int8", "sharded"])
def test_summed_and_sharded_decodes_equal_the_allgather_decode(transport):
    g = [torch.randn(3, 1000), torch.randn(3, 37)]
    by_gather = _roundtrip(3, g).averages
    named = [[(f"t{i}", x[r]) for i, x in enumerate(g)] for r in range(3)]
    other = exchange(3, named, min_numel=1, seed=3, transport=transport).averages
    for a, b in zip(other, by_gather):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_stats_time_each_phase_in_wall_and_cpu_seconds():
    import time

    from hvd_terngrad.stats import StatsRecorder

    st = StatsRecorder()
    with st.timed("comm"):  # waiting: wall time, next to no CPU
        time.sleep(0.05)
    with st.timed("encode"):  # work: CPU time close to the wall time
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
            pass
    c = st.current
    assert c.time_comm >= 0.05 and c.cpu_comm < 0.02
    assert c.time_encode >= 0.05 and 0.02 < c.cpu_encode <= c.time_encode + 0.01
    assert c.cpu_decode == c.time_decode == 0.0


def test_terngrad_state_loads_only_where_it_means_the_same():
    """state_dict(): the step and the residuals; other coding options are a ValueError naming them, another
    world size or rank drops the residuals with a warning, and speed options do not matter."""
    import warnings

    from tests.loopback import pipelines

    named = [[("w", torch.randn(300) * (r + 1))] for r in range(2)]
    run = exchange(2, named, min_numel=1, error_feedback=True, step=7)
    state = run.pipes[1].state_dict()
    assert state["step"] == 7 and set(state["feedback"]["worker"]) == {"w"}
    p = pipelines(2, TernGradConfig(min_numel=1, error_feedback=True, num_threads=1, timeout_s=5))[1]
    p.load_state_dict(state)
    assert p.step == 7 and torch.equal(p.coder.feedback.worker["w"], run.pipes[1].coder.feedback.worker["w"])
    with pytest.raises(ValueError, match=r"other options \(clip=2.5, now 0.0\), on rank 1"):
        pipelines(2, TernGradConfig(min_numel=1, error_feedback=True, clip=0.0))[1].load_state_dict(state)
    other = pipelines(4, TernGradConfig(min_numel=1, error_feedback=True))[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(state)
    assert "saved by rank 1 of 2, loaded on rank 1 of 4" in str(caught[0].message)
    assert other.step == 7 and not other.coder.feedback.worker


def test_owner_options_of_sharded_ternary_default_to_a_clipped_compensated_draw():
    import pytest

    from hvd_terngrad import TernGradConfig
    from hvd_terngrad.codec import Moments

    rec = TernGradConfig.recommended(transport="sharded-ternary")
    assert rec.owner_error_feedback and rec.owner_clip == 2.5 and rec.clip == 0.0  # follows error_feedback
    assert not TernGradConfig(transport="sharded-ternary").owner_error_feedback
    assert not TernGradConfig.recommended().owner_error_feedback  # only sharded-ternary's owners draw
    assert not TernGradConfig.recommended(transport="sharded-ternary", owner_error_feedback=False).owner_error_feedback
    st = Moments(0.0, 1.0, 10.0, 0)  # mean, std, max|g|, non-finite count
    assert rec.scaler(st) == 10.0 and rec.owner_scaler(st) == 2.5  # workers unclipped, owners clipped
    assert TernGradConfig(transport="sharded-ternary", owner_clip=0.0).owner_scaler(st) == 10.0
    for bad in (-1.0, float("nan"), True, "2.5"):
        with pytest.raises(ValueError, match="owner_clip must be a finite number"):
            TernGradConfig(owner_clip=bad)


def test_a_state_saved_before_owner_clip_loads_where_the_owners_draw_the_same():
    import pytest

    from hvd_terngrad import TernGradConfig
    from hvd_terngrad.checkpoint import STATE_VERSION, coding_options
    from hvd_terngrad.collectives.loopback import LoopbackWorld
    from hvd_terngrad.pipeline import Pipeline

    def state(cfg):  # as an earlier version saved it: no owner_clip among the options
        opts = {k: v for k, v in coding_options(cfg).items() if k != "owner_clip"}
        return {"version": STATE_VERSION, "step": 3, "rank": 0, "size": 1, "options": opts,
                "feedback": {"worker": {}, "owner": {}}}

    comm = LoopbackWorld(1).ranks()[0]
    for cfg in (TernGradConfig.recommended(), TernGradConfig(transport="sharded-ternary")):
        Pipeline(cfg, comm).load_state_dict(state(cfg))  # allgather: no owners; clip 2.5: owners clipped at 2.5
    rec = TernGradConfig.recommended(transport="sharded-ternary")
    with pytest.raises(ValueError, match="owner_clip=0.0, now 2.5"):  # its owners drew unclipped then
        Pipeline(rec, comm).load_state_dict(state(rec))
