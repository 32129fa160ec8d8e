"""benchmarks.step_probe's probe-only suffixes: what they accept, and that +naps and +spins change the waits
for their own method only."""
import pytest

import hvd_terngrad.collectives as coll
from benchmarks import step_probe

WAITS = ("_SPIN_S", "_POLLS_PER_CLOCK", "_NAP_FRACTION", "_NAP_MAX_S")


def _waits():
    return tuple(getattr(coll, k) for k in WAITS)


def test_the_suffixes_go_on_hvd_terngrads_optimizer_only():
    step_probe.check_methods(["fp32", "float+unchecked", "terngrad:auto+unchecked+naps", "terngrad+naps",
                              "ddp:python", "ddp:fp16c"])
    for bad, says in [("fp32+unchecked", "optimizer only"), ("ddp:terngrad:auto+naps", "optimizer only"),
                      ("ddp:python+naps", "optimizer only"), ("ddp:fp16c+unchecked", "optimizer only"),
                      ("terngrad:stock+unchecked", "optimizer only"), ("terngrad:auto+fast", "the suffixes are"),
                      ("terngrad:nope", "unknown|modifiers")]:
        with pytest.raises(ValueError, match=says):
            step_probe.check_methods(["fp32", bad])
    with pytest.raises(SystemExit):  # before any collective: argparse's error
        step_probe.main(["--methods", "fp32,fp16+naps"])
    with pytest.raises(SystemExit):  # no figure without two steps past the warm-up
        step_probe.main(["--steps", "51"])


def test_the_probes_wires_are_autos_uncoded_wires():
    from hvd_terngrad.transports.uncoded import UNCODED

    assert tuple(UNCODED) == step_probe.WIRES
    assert ("+coded", *("+" + w for w in UNCODED)) == step_probe.KINDS


def test_a_kind_suffix_forces_auto_s_kind_for_its_method_alone(monkeypatch):
    """+coded, +fp32 and +fp16 go on a method with transport auto, one at most; on the step of a method with
    one, the plan puts that kind in force at once, untried, and on another method's step auto plans its trial."""
    import hvd_terngrad.auto as auto
    from tests.test_auto import _steps

    step_probe.check_methods(["ddp:terngrad:auto+coded", "terngrad:auto+fp16", "terngrad:auto+unchecked+fp32"])
    for bad in ("ddp:fp32+coded", "terngrad+fp16", "terngrad:auto+coded+fp16", "float+fp32"):
        with pytest.raises(ValueError, match="transport auto"):
            step_probe.check_methods([bad])
    monkeypatch.setattr(auto.AutoPlan, "_plan", auto.AutoPlan._plan)  # put back after the test
    monkeypatch.setattr(step_probe, "_FORCED", [None])
    step_probe._force_kinds()
    plans = {}
    for kind in ("coded", "fp32", "fp16", None):
        step_probe._FORCED[0] = kind
        _steps(plans.setdefault(kind, auto.AutoPlan()), [0.01] * (auto.PLAN_STEP + 2))
    assert plans["coded"].decided and plans["coded"].coded is None
    assert plans["fp32"].decided and plans["fp32"].uncoded("bucket.0") and plans["fp32"].wire == "fp32"
    assert plans["fp16"].decided and plans["fp16"].uncoded("bucket.0") and plans["fp16"].wire == "fp16"
    assert not plans[None].decided and len(plans[None].trials) == 2  # its trial under way


def test_naps_nap_a_millisecond_from_the_first_poll_and_spins_spin_to_the_end_for_their_method_only():
    before = _waits()
    with step_probe._waits("terngrad:auto"):
        assert _waits() == before
    with pytest.raises(RuntimeError), step_probe._waits("terngrad:auto+naps"):
        spin, polls, fraction, nap = _waits()
        assert (spin, polls, nap) == (0.0, 1, 1e-3) and fraction < 1e-6  # min(waited / fraction, 1 ms): 1 ms
        raise RuntimeError("a step that fails still puts the waits back")
    assert _waits() == before
    with step_probe._waits("terngrad:auto+spins"):
        assert _waits()[0] == float("inf") and _waits()[1:] == before[1:]  # the bound is still read
    assert _waits() == before


def test_the_wide_task_is_a_large_model_on_a_fixed_batch_a_rank():
    """--task wide: three of DDP's 25 MB buckets' worth of parameters, the same batch each step on a rank."""
    import torch

    from benchmarks.step_probe import Wide

    net, idx = Wide().model(), torch.arange(8, 16)
    assert sum(p.numel() for p in net.parameters()) == 4 * 2048 * 2049 + 2049 * 10
    assert torch.equal(Wide().loss(net, idx), Wide().loss(net, idx)) and torch.isfinite(Wide().loss(net, idx))


def test_early_prints_each_methods_first_steps_one_by_one_beside_the_figures_past_the_warm_up():
    """--early N: where a trial's steps and a first step's set-up show, which the median past --warmup hides."""
    import argparse

    run = step_probe._Run.__new__(step_probe._Run)
    run.method, run.tg = "fp32", None
    run.times = [0.020, 0.0064] + [0.005] * 60
    run.cpu = [(0.001, 0.002)] * len(run.times)
    args = argparse.Namespace(task="ncf", warmup=50, early=3)
    head, early = run.report(args).split("\n")
    assert head.startswith("ncf fp32: median step 5.00 ms")  # the figures still leave out the warm-up
    assert early == "  its first 3 steps (ms): 20.0 6.4 5.0"
    assert "\n" not in run.report(argparse.Namespace(task="ncf", warmup=50, early=0))
