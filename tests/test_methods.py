"""One vocabulary for methods (hvd_terngrad/methods.py), and one table of transports (hvd_terngrad.transports)."""
import pytest

from hvd_terngrad import TernGradConfig
from hvd_terngrad.commcost import Link
from hvd_terngrad.methods import Method, parse_method
from hvd_terngrad.transports import TRANSPORTS, choose_transport


@pytest.mark.parametrize("text,name,stock,options", [
    ("fp32", "fp32", False, {}),
    ("terngrad", "terngrad", False, {"transport": "allgather"}),
    ("terngrad:allgather", "terngrad", False, {"transport": "allgather"}),
    ("terngrad:stock:summed", "terngrad:summed:stock", True, {"transport": "summed"}),
    ("terngrad:ef:noclip", "terngrad:noclip:ef", False,
     {"clip": 0.0, "error_feedback": True, "transport": "allgather"}),
    ("terngrad:block256:sharded:noclip", "terngrad:sharded:noclip:block256", False,
     {"clip": 0.0, "transport": "sharded", "block_size": 256}),
    ("ddp:terngrad:ef:sharded-ternary", "ddp:terngrad:sharded-ternary:ef", False,
     {"error_feedback": True, "transport": "sharded-ternary"}),
])
def test_method_names_parse_to_one_canonical_spelling(text, name, stock, options):
    m = parse_method(text)
    assert m.name == name and m.stock == stock and parse_method(m.name) == m
    if m.compression == "terngrad":
        assert m.terngrad_options() == options
        TernGradConfig(**m.terngrad_options())  # every spelled option is a valid configuration


@pytest.mark.parametrize("text", ["fp8", "fp32:summed", "local:sharded", "terngrad:bogus", "ddp:local", "ddp:fp32:ef",
                                  "ddp:terngrad:stock",
                                  "ddp:powersgd0", "ddp:powersgd4:ef", "ddp:powersgdx",
                                  "terngrad:summed:summed-int8", "terngrad:ef:ef", "terngrad:block100",
                                  "terngrad:block64:block128"])
def test_bad_method_names_say_what_is_allowed(text):
    with pytest.raises(ValueError, match="method|starts with|block_size"):
        parse_method(text)


def test_the_method_optimizer_follows_the_stock_modifier():
    assert Method("terngrad").optimizer == "hvd_terngrad"
    assert parse_method("local").optimizer == "none" and parse_method("local").name == "local"
    assert parse_method("terngrad:stock").optimizer == "stock" and parse_method("fp16").optimizer == "stock"
    assert all(parse_method(m).optimizer == "ddp" and parse_method(m).name == m
               for m in ("ddp:fp32", "ddp:fp16", "ddp:bf16", "ddp:powersgd", "ddp:powersgd4", "ddp:terngrad",
                         "ddp:terngrad:sharded"))
    assert parse_method("ddp:terngrad:hier").terngrad_options()["hierarchical"]
    assert parse_method("ddp:powersgd4").rank == 4 and parse_method("ddp:powersgd1") == parse_method("ddp:powersgd")


def test_every_transport_states_its_cost_and_auto_picks_the_cheapest_allowed():
    link = Link()
    for t in TRANSPORTS.values():
        assert t.seconds(1 << 20, 8, link) > 0 and t.submitted_bytes(1 << 20, 3) > 0 and t.collective
    # large buckets: the allgather up to 3 workers, then the sharded sums; sharded-ternary, whose owners draw
    # again, only by name
    assert [choose_transport(1 << 22, n) for n in (2, 3, 4, 64, 4096)] == ["allgather"] * 2 + ["sharded"] * 3
    assert not TRANSPORTS["sharded-ternary"].auto_ok
    assert choose_transport(1000, 64) == "allgather"  # small buckets: latency decides


def test_auto_plans_for_the_configured_link(monkeypatch):
    monkeypatch.delenv("HVD_TERNGRAD_LINK_GBPS", raising=False)
    assert TernGradConfig().link() == Link()
    assert TernGradConfig(link_gbps=100).link().bandwidth == 12.5e9
    monkeypatch.setenv("HVD_TERNGRAD_LINK_GBPS", "25")
    assert TernGradConfig().link().bandwidth == 25e9 / 8 and TernGradConfig(link_gbps=1).link().bandwidth == 1.25e8
    monkeypatch.setenv("HVD_TERNGRAD_LINK_GBPS", "fast")
    with pytest.raises(ValueError, match="HVD_TERNGRAD_LINK_GBPS"):
        TernGradConfig().link()
    with pytest.raises(ValueError, match="link_gbps"):
        TernGradConfig(link_gbps=0)
    # a slower link moves the allgather/sharded crossover down: more bytes matter more than more latency
    slow, fast = Link(bandwidth=1e6, latency=50e-6), Link(bandwidth=1e10, latency=50e-6)
    assert choose_transport(1 << 16, 32, slow) == "sharded" and choose_transport(1 << 16, 32, fast) == "allgather"
