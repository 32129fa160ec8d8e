"""Compare hvd_terngrad.commcost's communication time with the measured one, for every TernGrad run of a sweep.

    python -m benchmarks.transport_check results/transports/sweep.json

Prediction: the coded elements of the model (TernGradConfig defaults) through the run's transport, plus the
scaler Max allreduce and the float pass-through tensors, on the probed link (bandwidth, RTT / 2 latency).
Measured: the time TernGrad waited for communication per step (stats time_comm). With several ranks a node
the bytes are the node's; they are predicted for hierarchical runs (the transport between nodes), and the
flat runs' are shown measured only (what crosses a node's link then depends on MPI's algorithms).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.models import build
from hvd_terngrad.commcost import Link, allreduce_bytes, allreduce_time
from hvd_terngrad.methods import parse_method, split_of
from hvd_terngrad.transports import TRANSPORTS, choose_transport
from hvd_terngrad.wire import SCALER_ENTRY_BYTES


def split(model: str) -> tuple[int, int, int]:
    """(coded elements, coded tensors, float elements) under the default options."""
    s = split_of(build(model))
    return s.coded, s.tensors, s.floats


def hierarchical(row: dict) -> bool:
    return "hier" in parse_method(row.get("method") or row["compression"]).options


def predict_bytes(row: dict) -> float | None:
    """Bytes a node sends per step under ring algorithms: commcost's bandwidth terms (None: not predicted)."""
    coded, tensors, floats = split(row["model"])
    n = row["nodes"]
    if row.get("ranks_per_node", 1) > 1 and not hierarchical(row):
        return None
    per = TRANSPORTS[row.get("transport") or "allgather"].wire_bytes(coded, tensors, n)
    return per + allreduce_bytes(SCALER_ENTRY_BYTES * tensors + 4 * floats, n)


def predict(row: dict, link: Link) -> float:
    coded, tensors, floats = split(row["model"])
    n = row["nodes"]
    transport = row.get("transport") or "allgather"
    if transport == "auto":
        transport = choose_transport(coded, n, link, int8=True)
    return (TRANSPORTS[transport].seconds(coded, n, link) + allreduce_time(SCALER_ENTRY_BYTES * tensors, n, link)
            + allreduce_time(4 * floats, n, link))


def main(argv=None):
    path = Path((argv or sys.argv[1:])[0])
    data = json.loads(path.read_text())
    print("| model | profile | nodes | transport | predicted bytes sent/step | measured (eth0) | ratio | "
          "predicted comm (ms) | measured wait (ms) | ratio |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in data["rows"]:
        if r["compression"] != "terngrad" or "time_comm" not in r:
            continue
        probe = data["probes"].get(r["profile"], {})
        link = Link(bandwidth=probe["bandwidth_MBps"] * 1e6, latency=(probe.get("rtt_ms") or 0.05) / 2e3)
        pred = predict(r, link) * 1e3
        meas = r["time_comm"] * 1e3
        pb, mb = predict_bytes(r), r["wire_tx_per_step"]
        k = r.get("ranks_per_node", 1)
        nodes = f"{r['nodes']} x {k}" if k > 1 else f"{r['nodes']}"
        transport = (r.get("transport") or "allgather") + (", hierarchical" if hierarchical(r) else "")
        if pb is None:
            print(f"| {r['model']} | {r['profile']} | {nodes} | {transport} | | {mb:,.0f} | | | {meas:.1f} | |")
            continue
        print(f"| {r['model']} | {r['profile']} | {nodes} | {transport} | "
              f"{pb:,.0f} | {mb:,.0f} | {mb / pb:.3f} | {pred:.1f} | {meas:.1f} | {meas / pred:.2f} |")


if __name__ == "__main__":
    main()
