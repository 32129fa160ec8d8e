"""The performance model's arithmetic (benchmarks/perf_model.py, hvd_terngrad/commcost.py)."""
import pytest

from benchmarks.perf_model import CLUSTERS, GPU_CODEC, PAPER_MODELS, step_seconds
from hvd_terngrad.commcost import Link, allgather_time, allreduce_time
from hvd_terngrad.methods import Split, comm_seconds

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


def test_auto_is_never_below_fp32_at_1_to_512_gpus_and_codes_where_the_link_is_slow():
    for cl in CLUSTERS.values():
        for m in PAPER_MODELS.values():
            s = Split(int(m["params"] * 0.999), 20, int(m["params"] * 0.001))
            compute = m["batch"] / m["img_s"]
            for n in (2**k for k in range(1, 10)):
                args = (s, n, compute, compute * 2 / 3, cl["inter"], GPU_CODEC, (cl["gpus_per_node"], cl["intra"]))
                auto, fp32 = step_seconds("terngrad:auto", *args), step_seconds("fp32", *args)
                assert auto["total"] <= fp32["total"] * (1 + 1e-12), (n, m)
                if n == 512 and cl["inter"].bandwidth < 1e9:  # 1 Gbit/s between 128 nodes: coding pays
                    assert auto["total"] < 0.8 * fp32["total"] and auto["codec"] > 0
                if cl["inter"].bandwidth > 1e10 and fp32["comm"] < fp32["overlap"] + 1e-12:
                    assert auto["codec"] == 0.0  # FP32's average hides behind backward: nothing coded


def test_paper_inputs_are_named_and_positive():
    assert set(PAPER_MODELS) == {"AlexNet", "GoogLeNet", "VGG-A"}
    assert all(m["params"] > 1e6 and m["img_s"] > 0 for m in PAPER_MODELS.values())
    assert all(c["gpus_per_node"] * 128 == 512 for c in CLUSTERS.values())


# ---------------------------------------------------------------------------------------------
# The calibrated model of the emulated cluster (benchmarks/calibrate.py + timeline.host_step_seconds).
from benchmarks.calibrate import bandwidth_bytes, fit  # noqa: E402
from benchmarks.timeline import Curve, Host, host_step_seconds  # noqa: E402


def test_fit_recovers_latency_and_bandwidth():
    pts = [(x, 1e-3 + x / 1e8) for x in (1e4, 1e5, 1e6, 1e7)]
    f = fit(pts)
    assert f["latency_s"] == pytest.approx(1e-3, rel=1e-6)
    assert f["bandwidth_Bps"] == pytest.approx(1e8, rel=1e-6)
    assert f["worst_fit_error"] < 1e-9
    assert bandwidth_bytes("allgather_u8", 100, 4) == 300
    assert bandwidth_bytes("allreduce_fp32", 100, 4) == pytest.approx(150)


def test_curve_interpolates_and_extends():
    c = Curve([(100, 1.0), (200, 3.0)])
    assert c(150) == pytest.approx(2.0)
    assert c(50) == pytest.approx(1.0)  # a call's fixed cost below the smallest size
    assert c(300) == pytest.approx(5.0)  # the last segment's slope beyond the largest
    assert Curve([(100, 1.0), (200, 3.0)], origin=True)(50) == pytest.approx(0.5)


def _host(bandwidth=100e6, latency=1e-3, ready=None):
    """A host whose collectives cost latency + bytes / bandwidth and whose codec costs 1 ns per element."""
    pts = [(b, latency + b / bandwidth) for b in (1e3, 1e6, 1e8)]
    curves = {k: Curve(pts) for k in ("allreduce_fp32", "allreduce_fp16", "allgather_u8", "allreduce_int8",
                                      "alltoall_u8")}
    per = [(e, e * 1e-9) for e in (1e5, 1e7)]
    codec = {t: {"encode": Curve(per, origin=True), "decode": Curve(per, origin=True)}
             for t in ("allgather", "summed", "summed-int8", "sharded", "sharded-ternary")}
    for t in ("sharded", "sharded-ternary"):
        codec[t]["owner"] = Curve(per, origin=True)
    compute = {"mlp:32": {"step": 0.10, "forward": 0.03, "backward": 0.06, "ready": ready or {}}}
    return Host(4, compute, codec, curves)


def test_without_overlap_the_step_is_compute_plus_comm():
    st = host_step_seconds("fp32", "mlp", 32, _host(), overlap=False)
    assert st["total"] == pytest.approx(st["compute"] + st["comm"], rel=1e-9)
    assert st["overlap"] == pytest.approx(0.0, abs=1e-12)
    # one fused allreduce: 10.5 M fp32 parameters
    assert st["comm"] == pytest.approx(1e-3 + 4 * 10_510_346 / 100e6, rel=1e-3)


def test_overlap_hides_communication_behind_backward_only():
    # every gradient ready at the start of backward: communication overlaps all of backward
    from benchmarks.models import param_sizes

    early = {n: 0.0 for n, _ in param_sizes("mlp")}
    host = _host(bandwidth=1e9, ready=early)
    st = host_step_seconds("fp32", "mlp", 32, host)
    flat = host_step_seconds("fp32", "mlp", 32, host, overlap=False)
    assert st["total"] < flat["total"]
    assert st["total"] >= max(st["compute"], st["comm"]) - 1e-12
    assert st["overlap"] <= 0.06 + 1e-12  # never more than backward


def test_terngrad_step_pays_codec_and_far_fewer_bytes():
    host = _host()
    f32 = host_step_seconds("fp32", "mlp", 32, host, overlap=False)
    tg = host_step_seconds("terngrad", "mlp", 32, host, overlap=False)
    assert tg["codec"] == pytest.approx(2 * 10_510_336 * 1e-9, rel=1e-6)  # encode + decode of every coded element
    assert tg["comm"] < f32["comm"] / 10
    for transport in ("summed", "summed-int8"):
        st = host_step_seconds(f"terngrad:{transport}", "mlp", 32, host, overlap=False)
        assert st["comm"] > tg["comm"] and st["total"] > tg["total"]


def test_sharded_step_is_an_alltoall_then_the_owners_work_then_a_reply_allgather():
    from hvd_terngrad.transports import TRANSPORTS

    host, coded = _host(), 10_510_336
    trace = []
    st = host_step_seconds("terngrad:sharded-ternary", "mlp", 32, host, overlap=False, trace=trace)
    assert st["codec"] == pytest.approx(3 * coded * 1e-9, rel=1e-6)  # encode, owner reply, decode
    kinds = [k for _, _, k, _, _ in trace]
    assert kinds.count("alltoall_u8") == kinds.count("allgather_u8") >= 1
    a2a_ends = sorted(end for _, end, k, _, _ in trace if k == "alltoall_u8")
    reply_starts = sorted(start for start, _, k, _, _ in trace if k == "allgather_u8")
    assert all(r >= a for a, r in zip(a2a_ends, reply_starts))  # a reply leaves after its codes reached the owner
    tr = TRANSPORTS["sharded-ternary"]
    a2a = sum(nb for _, _, k, nb, _ in trace if k == "alltoall_u8")
    gather = sum(nb for _, _, k, nb, _ in trace if k == "allgather_u8")
    assert a2a == pytest.approx(coded / 4, rel=1e-3) and gather == pytest.approx(coded / 4 / 4, rel=1e-3)
    # a 256-byte shard and its scaler (the formula allows each tensor's codes a partial byte)
    assert tr.reply_submitted_bytes(4096, 1, 4) - (256 + 4) in (0, 1)
    sharded = host_step_seconds("terngrad:sharded", "mlp", 32, host, overlap=False)
    assert sharded["comm"] > st["comm"]  # 4-bit sums come back instead of 2-bit codes


def test_cpu_bound_communication_does_not_hide_behind_backward():
    from dataclasses import replace

    from benchmarks.models import param_sizes

    early = {n: 0.0 for n, _ in param_sizes("mlp")}
    host = _host(bandwidth=1e9, ready=early)
    busy = replace(host, cpu={k: Curve([(1e3, 1.0), (1e8, 1.0)]) for k in host.curves})
    flat = host_step_seconds("fp32", "mlp", 32, host, overlap=False)["total"]
    assert host_step_seconds("fp32", "mlp", 32, host)["total"] < flat - 0.02
    assert host_step_seconds("fp32", "mlp", 32, busy)["total"] == pytest.approx(flat, rel=1e-6)


def test_waiting_requests_of_one_kind_fuse_past_others():
    # every gradient ready at once: Horovod fuses the buckets' scaler Max allreduces into one call, apart from
    # the pass-through floats' Average allreduce, whatever order they were submitted in
    from benchmarks.models import param_sizes
    from hvd_terngrad import TernGradConfig
    from hvd_terngrad.buckets import plan_buckets

    params = param_sizes("mlp")
    host = _host(ready={n: 0.0 for n, _ in params})
    trace = []
    host_step_seconds("terngrad", "mlp", 32, host, trace=trace)
    groups, floats = plan_buckets([(n, e, 4) for n, e in params], TernGradConfig(), 4 << 20)
    coded = sum(len(g) for g in groups)
    assert len(groups) > 1 and floats
    scalers = [t for t in trace if t[2] == "allreduce_fp32" and t[3] == 16 * coded]
    assert len(scalers) == 1
    assert sum(t[2] == "allreduce_fp32" for t in trace) == 2  # the fused scalers and the fused floats


def test_stretch_beside_compute_is_read_per_size():
    from dataclasses import replace

    from benchmarks.models import param_sizes

    host = _host(bandwidth=1e9, ready={n: 0.0 for n, _ in param_sizes("mlp")})
    flat = host_step_seconds("fp32", "mlp", 32, host, overlap=False)["total"]
    free = host_step_seconds("fp32", "mlp", 32, host)["total"]
    sizes = [1e3, 1e6, 1e8]
    same = replace(host, beside={k: c for k, c in host.curves.items()},
                   cpu={k: Curve([(b, 0.0) for b in sizes]) for k in host.curves})
    assert host_step_seconds("fp32", "mlp", 32, same)["total"] == pytest.approx(free, rel=1e-9)
    # a call that barely moves beside compute (a time slice per message exchange) hides nothing
    stuck = replace(same, beside={k: Curve([(b, 1e3 * c(b)) for b in sizes]) for k, c in host.curves.items()})
    assert host.beside_compute("allreduce_fp32", 1e6, host.curves["allreduce_fp32"](1e6)) == (1.0, 0.0)
    assert stuck.beside_compute("allreduce_fp32", 1e6, host.curves["allreduce_fp32"](1e6))[0] == pytest.approx(1e3)
    assert host_step_seconds("fp32", "mlp", 32, stuck)["total"] == pytest.approx(flat, rel=1e-3)


def test_codec_work_after_backward_slows_collectives_in_flight():
    # a collective that barely moves beside compute cannot hide behind backward, nor behind the encodes and
    # decodes synchronize() runs on the main thread: the step is then compute + codec + comm, in series
    from dataclasses import replace

    from benchmarks.models import param_sizes

    host = _host(bandwidth=1e8, ready={n: 0.0 for n, _ in param_sizes("mlp")})
    sizes = [1e3, 1e6, 1e8]
    cpu0 = {k: Curve([(b, 0.0) for b in sizes]) for k in host.curves}
    same = replace(host, beside=dict(host.curves), cpu=cpu0)
    stuck = replace(host, beside={k: Curve([(b, 1e3 * c(b)) for b in sizes]) for k, c in host.curves.items()},
                    cpu=cpu0)
    for method in ("terngrad", "terngrad:summed"):
        free, slow = host_step_seconds(method, "mlp", 32, same), host_step_seconds(method, "mlp", 32, stuck)
        assert slow["total"] > free["total"]
        assert slow["total"] >= 0.99 * (slow["compute"] + slow["codec"] + slow["comm"])


def test_fp16_casts_come_from_the_probe_and_a_result_is_cast_back_while_later_calls_run():
    # Compression.fp16: cast in the hook, cast back in synchronize() as each result arrives. The job's probe
    # times the casts with training's allocations; the calibration's curves are only the fallback.
    from benchmarks.models import param_sizes

    params = param_sizes("mlp")  # net.1 6.3 M, net.3 4.2 M, net.5 20 K elements (+ biases)
    ready = {n: 0.06 if n.startswith("net.1") else 0.03 if n.startswith("net.3") else 0.0 for n, _ in params}
    host = _host(bandwidth=1e8, ready=ready)
    host.codec["fp16"] = host.codec["allgather"]  # 1 ns per element each way
    numel = sum(e for _, e in params)
    assert host_step_seconds("fp16", "mlp", 32, host)["codec"] == pytest.approx(2 * numel * 1e-9, rel=1e-6)

    def casts(slow: str | None):
        return {"encode": {n: 0.0 for n, _ in params}, "decode": {n: 0.02 if n == slow else 0.0 for n, _ in params}}

    def total(slow):
        st = host_step_seconds("fp16", "mlp", 32, host, compute={**host.compute["mlp:32"], "fp16_casts": casts(slow)})
        return st["total"], st["codec"]

    t0, c0 = total(None)
    assert c0 == 0.0
    # net.3's result arrives while net.1's call (the last) is still in flight: casting it back costs nothing
    t3, c3 = total("net.3.weight")
    assert c3 == pytest.approx(0.02) and t3 == pytest.approx(t0, abs=1e-9)
    # the last call's result can only be cast back after it
    t1, c1 = total("net.1.weight")
    assert t1 == pytest.approx(t0 + 0.02, rel=1e-9)


def test_validate_reads_each_sweep_against_its_own_calibration(tmp_path, capsys):
    # two sweeps of the same (profile, N) cluster, calibrated on links 10x apart: each row must be predicted
    # from its own sweep's calibration, not from whichever file came last
    import json

    from benchmarks.perf_model import main

    def sweep(bandwidth, step):
        per = [[e, e * 1e-9] for e in (1e5, 1e7)]
        cal = {"profile": "p", "nodes": 2, "compute": {},
               "codec": {t: {"encode": per, "decode": per} for t in ("allgather", "summed", "summed-int8", "fp16")},
               "collectives": {k: {"points": [[b, 1e-3 + b / bandwidth] for b in (1e3, 1e6, 1e8)]}
                               for k in ("allreduce_fp32", "allreduce_fp16", "allgather_u8", "allreduce_int8")}}
        probe = {"step": 0.1, "forward": 0.03, "backward": 0.06, "ready": {}}
        row = {"model": "mlp", "profile": "p", "nodes": 2, "method": "fp32", "compression": "fp32",
               "batch_size": 32, "step_seconds": step, "compute_probe": probe}
        return {"rows": [row], "calibration": [cal]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(sweep(1e8, 0.1 + 0.001 + 4 * 10_510_346 / 1e8)))
    b.write_text(json.dumps(sweep(1e9, 0.1 + 0.001 + 4 * 10_510_346 / 1e9)))
    assert main(["validate", str(a), str(b), "--no-overlap"]) == 0
    assert "within +-15%: 2 of 2" in capsys.readouterr().out


def test_sharded_transports_in_the_extrapolation():
    """Flat sharded-ternary beats the allgather and the summed transport at 512 GPUs on Ethernet; one leader per
    node beats flat; in one node the codes take the fast link."""
    eth = CLUSTERS["1 Gbps Ethernet + PCIe"]
    hier = (eth["gpus_per_node"], eth["intra"])
    s = Split(60_000_000, 20, 60_000)
    t = {m: comm_seconds(m, s, 512, eth["inter"], hier) for m in
         ("fp32", "terngrad", "terngrad:summed", "terngrad:sharded", "terngrad:sharded-ternary",
          "terngrad:sharded-ternary:hier")}
    assert t["terngrad:sharded-ternary"] < t["terngrad:summed"] < t["terngrad"]
    assert t["terngrad:sharded-ternary:hier"] < t["terngrad:sharded-ternary"] < t["fp32"] / 3
    one_node, two_nodes = (comm_seconds("terngrad:sharded-ternary", s, n, eth["inter"], hier) for n in (4, 8))
    assert one_node < two_nodes / 10  # inside one node the codes cross PCIe, not Ethernet
    with pytest.raises(ValueError, match="unknown method"):
        comm_seconds("terngrad:sharded:flat", s, 8, eth["inter"], hier)
