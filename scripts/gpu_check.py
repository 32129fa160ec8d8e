"""The GPU check: what a machine with one CUDA GPU must show, in one run of a few minutes, as one report.

    bash scripts/gpu_check.sh [OUT]          (OUT: default build/gpu-check; report.json and report.md there)

1. the test suite's CUDA tests (tests/test_codec.py, where the cuda backend is one of the parametrized ones);
2. the codec benchmark's device rows: encode and decode against a device-to-device copy;
3. CPU/GPU bit identity: the golden vectors (tests/golden/codec_v1.json, codec_v2.json) through the cuda
   backend, and random tensors of every dtype, codes, decodes and error feedback's residuals against the CPU
   backend's;
4. a 1-GPU training of the main job's digits CNN with the cuda backend: 2 workers simulated on the GPU through
   the library's pipeline (loopback collectives), beside FP32.

--allow-cpu runs steps 3 and 4 on the CPU backend instead (CI runs it, so that this script cannot rot where
no GPU is); steps 1 and 2 then report "skipped: no GPU".
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def cuda_tests() -> dict:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-k", "cuda", "tests/test_codec.py",
                          "tests/test_sharded.py", "tests/test_block_scalers.py", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (res.stdout + res.stderr).strip().splitlines()
    return {"ok": res.returncode == 0, "summary": tail[-1] if tail else "", "seconds": time.monotonic() - t0}


def device_rows(sizes: list[int]) -> list[dict]:
    from benchmarks import codec_bench

    return codec_bench.gpu_rows(sizes)


def identity(device: str) -> dict:
    """Codes and decodes of `device`'s backend equal the CPU backend's: golden vectors and random tensors."""
    from hvd_terngrad import codec
    from tests.golden.make_golden import block_case, golden_input

    backend = "cuda" if device == "cuda" else "cpu"
    checked, failed = 0, []
    for version in ("codec_v1", "codec_v2"):
        for case in json.loads((ROOT / "tests" / "golden" / f"{version}.json").read_text())["cases"]:
            if case.get("block_size"):
                x, scalers, block, key = block_case(case)
                codes = codec.ternarize_pack_blocks(x.to(device), scalers, block, key, backend=backend)
            else:
                x = golden_input(case["n"], case["dtype"]).to(device)
                key = codec.RngKey(case["seed"], case["step"], case["rank"], case["tensor_id"])
                codes = codec.ternarize_pack(x, case["scaler"], key, backend=backend)
            checked += 1
            if bytes(codes.cpu().tolist()).hex() != case["packed_hex"]:
                failed.append(f"{version}:{case['name']}")
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for n in (1, 13, 4097, 1 << 20):
            x = (torch.randn(n, generator=g) * 0.01).to(dtype)
            key = codec.RngKey(7, 3, 1, n)
            s = float(codec.moments(x, backend="cpu").absmax)
            mine = codec.ternarize_pack(x.to(device), s, key, backend=backend)
            cpu = codec.ternarize_pack(x, s, key, backend="cpu")
            dec = codec.decode_mean([mine, mine], [s, s], True, n, backend=backend)
            checked += 1
            if not (torch.equal(mine.cpu(), cpu) and
                    torch.equal(dec.cpu(), codec.decode_mean([cpu, cpu], [s, s], True, n, backend="cpu"))):
                failed.append(f"random:{dtype}:{n}")
            # error feedback fused in (section 13): codes of x + r and the residual written over r
            r = (torch.randn(n, generator=g) * 0.003).to(dtype)
            r_dev, r_cpu = r.to(device), r.clone()
            mine = codec.ternarize_pack(x.to(device), s, key, residual=r_dev, residual_out=r_dev, backend=backend)
            cpu = codec.ternarize_pack(x, s, key, residual=r_cpu, residual_out=r_cpu, backend="cpu")
            checked += 1
            same_r = torch.equal(r_dev.cpu().view(torch.uint8), r_cpu.view(torch.uint8))
            if not (torch.equal(mine.cpu(), cpu) and same_r):
                failed.append(f"feedback:{dtype}:{n}")
    return {"ok": not failed, "checked": checked, "failed": failed}


def training(device: str, epochs: int) -> dict:
    """The digits CNN, 2 simulated workers on `device`: FP32 against TernGrad with the device's backend."""
    from benchmarks.simulator import SimulatedWorkers
    from examples.digits import DigitsCNN, load_data
    from hvd_terngrad import TernGradConfig

    (xtr, ytr), (xte, yte) = load_data()
    xtr, ytr, xte, yte = xtr.to(device), ytr.to(device), xte.to(device), yte.to(device)
    out = {}
    for method in ("fp32", "terngrad"):
        torch.manual_seed(0)
        model = DigitsCNN().to(device)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(backend="cuda" if device == "cuda" else
                                                                        "cpu"), 2) if method == "terngrad" else None
        t0 = time.monotonic()
        for epoch in range(epochs):
            perm = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(epoch)).to(device)
            for i in range(0, len(perm) - 63, 64):
                grads = []
                for r in range(2):  # each worker's half of the batch
                    idx = perm[i + 32 * r: i + 32 * (r + 1)]
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
                    grads.append([p.grad.clone() for p in params])
                avg = sim.average(grads) if sim else [(a + b) / 2 for a, b in zip(*grads)]
                for p, g in zip(params, avg):
                    p.grad = g
                opt.step()
        model.eval()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        out[method] = {"test_accuracy": acc, "seconds": time.monotonic() - t0}
    out["ok"] = out["terngrad"]["test_accuracy"] >= out["fp32"]["test_accuracy"] - 0.03
    return out


def markdown(report: dict) -> str:
    verdict = "ok" if report["ok"] else "FAILED"
    lines = [f"# GPU check ({report['device']}, {report['date']})", "", f"overall: **{verdict}**", "",
             "| step | result |", "|---|---|"]
    for step in ("cuda_tests", "identity", "training"):
        lines.append(f"| {step} | {json.dumps(report[step])} |")
    lines += ["", "| n | d2d copy GB/s | encode GB/s | decode GB/s | encode / copy time | codes = CPU | decode = CPU |",
              "|---:|---:|---:|---:|---:|---|---|"]
    for r in report["device_rows"] if isinstance(report["device_rows"], list) else []:
        lines.append(f"| {r['n']} | {r['d2d_copy']:.0f} | {r['encode']:.0f} | {r['decode']:.0f} | "
                     f"{r['encode_vs_copy']:.2f} | {r['codes_bit_identical_to_cpu']} | "
                     f"{r['decode_bit_identical_to_cpu']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "build" / "gpu-check"))
    ap.add_argument("--allow-cpu", action="store_true", help="without a GPU, run steps 3 and 4 on the CPU")
    ap.add_argument("--epochs", type=int, default=12)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and not args.allow_cpu:
        print("gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); this check needs "
              "one. Nothing was run. (--allow-cpu runs its CPU-only path.)", file=sys.stderr)
        return 2
    device = "cuda" if gpu else "cpu"
    report = {"device": torch.cuda.get_device_name() if gpu else "cpu (no GPU)", "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__}
    report["cuda_tests"] = cuda_tests() if gpu else "skipped: no GPU"
    report["device_rows"] = device_rows([1 << 20, 16 << 20, 64 << 20]) if gpu else "skipped: no GPU"
    report["identity"] = identity(device)
    report["training"] = training(device, args.epochs)
    report["ok"] = all(isinstance(report[k], str) or report[k]["ok"] for k in ("cuda_tests", "identity", "training"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
