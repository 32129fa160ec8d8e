"""The performance model's arithmetic (benchmarks/perf_model.py, hvd_terngrad/perfmodel.py)."""
import pytest

from benchmarks.perf_model import CLUSTERS, GPU_CODEC, PAPER_MODELS, Split, comm_seconds, step_seconds
from hvd_terngrad.perfmodel import Link, allgather_time, allreduce_time

LINK = Link(bandwidth=100e6, latency=0.0)


def test_ring_and_allgather_byte_terms():
    assert allreduce_time(4e6, 4, LINK) == pytest.approx(2 * 3 / 4 * 4e6 / 100e6)
    assert allgather_time(1e6, 4, LINK) == pytest.approx(3 * 1e6 / 100e6)
    assert allreduce_time(4e6, 1, LINK) == 0.0


def test_terngrad_allgather_against_fp32_bandwidth_ratio():
    s = Split(coded=10_000_000, tensors=1, floats=0)
    # allgather (N-1) n/4 vs ring 2 (N-1)/N 4n: ratio N/32 -> TernGrad cheaper below N = 32 on bytes
    for n in (2, 4, 8, 16):
        assert comm_seconds("terngrad", s, n, LINK) < comm_seconds("fp32", s, n, LINK)
    assert comm_seconds("terngrad", s, 64, LINK) > comm_seconds("fp32", s, 64, LINK)
    assert comm_seconds("terngrad:summed", s, 64, LINK) < comm_seconds("fp32", s, 64, LINK)


def test_hierarchy_with_one_gpu_per_node_is_flat():
    s = Split(coded=1_000_000, tensors=3, floats=1000)
    for m in ("fp32", "terngrad", "terngrad:summed"):
        assert comm_seconds(m, s, 8, LINK, hier=(1, Link(1e10, 0.0))) == pytest.approx(comm_seconds(m, s, 8, LINK))


def test_step_has_no_communication_on_one_worker():
    s = Split(coded=1_000_000, tensors=3, floats=1000)
    st = step_seconds("terngrad", s, 1, 0.1, 0.05, LINK, GPU_CODEC)
    assert st["total"] == pytest.approx(0.1) and st["comm"] == 0.0


def test_overlap_never_exceeds_backward_or_comm():
    s = Split(coded=50_000_000, tensors=10, floats=0)
    st = step_seconds("fp32", s, 8, 0.3, 0.2, LINK, None)
    assert st["overlap"] == pytest.approx(0.2)
    assert st["total"] == pytest.approx(0.3 + st["comm"] - 0.2)


def test_paper_inputs_are_named_and_positive():
    assert set(PAPER_MODELS) == {"AlexNet", "GoogLeNet", "VGG-A"}
    assert all(m["params"] > 1e6 and m["img_s"] > 0 for m in PAPER_MODELS.values())
    assert all(c["gpus_per_node"] * 128 == 512 for c in CLUSTERS.values())
