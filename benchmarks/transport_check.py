"""Compare hvd_terngrad.commcost's communication time with the measured one, for every TernGrad run of a sweep.

    python -m benchmarks.transport_check results/transports/sweep.json

Prediction: the coded elements of the model (TernGradConfig defaults) through the run's transport, plus the
scaler Max allreduce and the float pass-through tensors, on the probed link (bandwidth, RTT / 2 latency).
Measured: the time TernGrad waited for communication per step (stats time_comm).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.models import build, split_of
from hvd_terngrad.commcost import Link, allreduce_bytes, allreduce_time
from hvd_terngrad.transports import TRANSPORTS, choose_transport
from hvd_terngrad.wire import SCALER_ENTRY_BYTES


def split(model: str) -> tuple[int, int, int]:
    """(coded elements, coded tensors, float elements) under the default options."""
    s = split_of(build(model))
    return s.coded, s.tensors, s.floats


def predict_bytes(row: dict) -> float:
    """Bytes a node sends per step under ring algorithms: commcost's bandwidth terms."""
    coded, tensors, floats = split(row["model"])
    n = row["nodes"]
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
        print(f"| {r['model']} | {r['profile']} | {r['nodes']} | {r.get('transport') or 'allgather'} | "
              f"{pb:,.0f} | {mb:,.0f} | {mb / pb:.3f} | {pred:.1f} | {meas:.1f} | {meas / pred:.2f} |")


if __name__ == "__main__":
    main()
