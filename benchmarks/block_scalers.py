"""Block scalers against one scaler a tensor: the error they leave, the bytes they add, the time they take.

    python -m benchmarks.block_scalers                   # tables to stdout and results/block_scalers/
    python -m benchmarks.block_scalers --workers 8 --blocks 64,256,1024,4096

Error. For the fidelity suite's models (benchmarks/fidelity_suite.py), after 30 FP32 steps, N workers each take
the gradient of their own batch. For every coded tensor (the classifier excluded, as in the suite) the expected
relative error of TernGrad's average against the workers' true average, E||g_hat - g_bar||^2 / ||g_bar||^2, is
computed exactly rather than sampled: an element with |g| <= s contributes the variance |g| (s - |g|) / N^2, a
clipped one the bias sign(g) (s - |g|) / N, summed over workers. The scaler is shared (Max over workers).
Rules compared, each per tensor and per block of k elements:
  tensor-clip   s_b = min(c std(tensor), max_b|g|)   hvd_terngrad's rule (TernGradConfig.block_scalers)
  block-clip    s_b = min(c std(block), max_b|g|)    the alternative: clipping decided block by block
  no clip       s_b = max_b|g|                       unbiased
Bytes: what a worker hands the collectives per coded element: 2-bit codes plus a shared block scaler's 2 bytes
(wire.BLOCK_SCALER_BYTES) a block in the Max allreduce. Time: the CPU codec's encode of one 4M-element fp32 tensor
(statistics with block maxima, coding), median of repeats, per-tensor and block scalers side by side in one run.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.fidelity_suite import TASKS, Data
from hvd_terngrad import TernGradConfig, codec, wire

CLIP = 2.5
RULES = ("tensor-clip", "block-clip", "noclip")


def _blocks(g: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([g, g.new_zeros((-g.numel()) % k)]).view(-1, k)


def block_scalers(g: torch.Tensor, k: int, rule: str) -> torch.Tensor:
    """One worker's scaler per block of k elements (k >= numel: the paper's one scaler), fp64."""
    gb = _blocks(g, k)
    bmax = gb.abs().max(dim=1).values
    if rule == "noclip":
        return bmax
    if rule == "tensor-clip":
        return bmax.clamp(max=CLIP * float(g.std(unbiased=False)))
    count = torch.full((gb.shape[0],), float(k), dtype=torch.float64)
    count[-1] = k - (-g.numel()) % k
    mean = gb.sum(dim=1) / count
    var = ((gb * gb).sum(dim=1) / count - mean * mean).clamp(min=0)
    return torch.minimum(bmax, CLIP * var.sqrt())


def expected_error(grads: list[torch.Tensor], k: int, rule: str) -> tuple[float, float]:
    """(variance, squared bias) of the shared-scaler average of the workers' ternary gradients, summed over
    elements; fp64."""
    n = len(grads)
    s = torch.stack([block_scalers(g, k, rule) for g in grads]).max(dim=0).values[:, None]
    var, bias = 0.0, 0.0
    for g in grads:
        gb = _blocks(g, k)
        a = gb.abs()
        var += float(torch.where(a <= s, a * (s - a), torch.zeros_like(a)).sum())
        bias = bias + torch.sign(gb) * (torch.minimum(a, s) - a)
    return var / n**2, float(((bias / n) ** 2).sum())


def worker_gradients(task: str, workers: int, warm_steps: int = 30) -> dict[str, list[torch.Tensor]]:
    """Coded tensors' gradients (fp64, flat) of `workers` batches, after warm_steps of FP32 SGD on the global
    batch of `workers` workers, as the suite trains."""
    t = TASKS[task]
    data = Data(t)
    torch.manual_seed(0)
    model = data.model()
    opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(warm_steps):
        opt.zero_grad()
        data.loss(model, torch.randperm(data.n_train, generator=g)[: t.batch * workers]).backward()
        opt.step()
    order = torch.randperm(data.n_train, generator=g)
    cfg = TernGradConfig(exclude=(t.classifier,))
    out: dict[str, list[torch.Tensor]] = {}
    for r in range(workers):
        model.zero_grad()
        data.loss(model, order[r * t.batch: (r + 1) * t.batch]).backward()
        for name, p in model.named_parameters():
            if cfg.compresses(name, p.numel()) and not fnmatch.fnmatchcase(name, t.classifier):
                out.setdefault(name, []).append(p.grad.detach().reshape(-1).double().clone())
    return out


def error_table(tasks: list[str], workers: int, blocks: list[int]) -> list[dict]:
    rows = []
    for task in tasks:
        grads = worker_gradients(task, workers)
        norm = sum(float((sum(gs) / len(gs)).pow(2).sum()) for gs in grads.values())
        for n in (1, workers):
            for rule in RULES:
                for k in [0, *blocks]:
                    if k == 0 and rule == "block-clip":
                        continue  # one block: the same as tensor-clip
                    var = bias = 0.0
                    for gs in grads.values():
                        v, b = expected_error(gs[:n], k or gs[0].numel(), rule)
                        var, bias = var + v, bias + b
                    rows.append({"task": task, "workers": n, "rule": rule, "block": k or None,
                                 "variance": var / norm, "bias2": bias / norm, "error": (var + bias) / norm})
    return rows


def bytes_per_element(k: int | None) -> float:
    return 0.25 + (wire.BLOCK_SCALER_BYTES / k if k else 0.0)


def encode_times(blocks: list[int], n: int = 1 << 22, repeats: int = 15) -> list[dict]:
    """Median seconds of the CPU encode (statistics, block maxima, coding) at 1 and 2 threads."""
    x = torch.randn(n) * torch.linspace(0.01, 1, n)
    key = codec.RngKey(1, 2, 3, 4)
    out = torch.empty(codec.codes_size(n), dtype=torch.uint8)
    rows = []
    for nt in (1, 2):
        def per_tensor(nt=nt):
            st = codec.moments(x, nthreads=nt)
            codec.ternarize_pack(x, TernGradConfig().scaler(st), key, out=out, nthreads=nt)

        def per_block(k, nt=nt):
            st, absmax = codec.moments_blocks(x, k, nthreads=nt)
            s = TernGradConfig(block_size=k).block_scalers(st, absmax)
            codec.ternarize_pack_blocks(x, s, k, key, out=out, nthreads=nt)

        cands = [(None, per_tensor)] + [(k, lambda k=k: per_block(k)) for k in blocks]
        times = {k: [] for k, _ in cands}
        for _ in range(repeats):  # interleaved, so that machine noise hits every candidate alike
            for k, f in cands:
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        base = statistics.median(times[None])
        for k, _ in cands:
            med = statistics.median(times[k])
            rows.append({"threads": nt, "block": k, "ms": 1e3 * med, "vs_tensor": med / base,
                         "melem_per_s": n / med / 1e6})
    return rows


def markdown(errors: list[dict], times: list[dict], workers: int, blocks: list[int]) -> str:
    lines = [f"Relative error E||g_hat - g_bar||^2 / ||g_bar||^2 of the average over N workers (variance + bias^2), "
             f"shared scalers, c = {CLIP}:", ""]
    heads = ["per tensor"] + [f"k = {k}" for k in blocks]
    lines += ["| task | N | rule | " + " | ".join(heads) + " |", "|---|---:|---|" + "---:|" * len(heads)]
    for task in dict.fromkeys(r["task"] for r in errors):
        for n in (1, workers):
            for rule in RULES:
                cells = []
                for k in [None, *blocks]:
                    hit = [r for r in errors if (r["task"], r["workers"], r["rule"], r["block"]) == (task, n, rule, k)]
                    if not hit and k is None and rule == "block-clip":
                        hit = [r for r in errors if (r["task"], r["workers"], r["rule"], r["block"]) ==
                               (task, n, "tensor-clip", None)]
                    r = hit[0]
                    cells.append(f"{r['error']:.3f} ({r['bias2']:.3f})")
                lines.append(f"| {task} | {n} | {rule} | " + " | ".join(cells) + " |")
    lines += ["", "(in brackets: the squared bias, which averaging over workers does not shrink)", "",
              "| | per tensor | " + " | ".join(f"k = {k}" for k in blocks) + " |",
              "|---|---:|" + "---:|" * len(blocks),
              "| bytes a coded element | " + " | ".join(f"{bytes_per_element(k):.4f}" for k in [None, *blocks]) + " |",
              "| compression vs fp32 | " + " | ".join(f"{4 / bytes_per_element(k):.1f}x" for k in [None, *blocks])
              + " |"]
    for nt in (1, 2):
        row = [r for r in times if r["threads"] == nt]
        lines.append(f"| encode, {nt} thread{'s' if nt > 1 else ''} (ms; x per tensor) | "
                     + " | ".join(f"{r['ms']:.1f} ({r['vs_tensor']:.2f}x)" for r in row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="lenet,resnet,charlm")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", default="64,256,1024,4096")
    ap.add_argument("--out", default="results/block_scalers")
    args = ap.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    torch.set_num_threads(1)
    errors = error_table(args.tasks.split(","), args.workers, blocks)
    times = encode_times(blocks)
    md = markdown(errors, times, args.workers, blocks)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_scalers.json").write_text(json.dumps({"errors": errors, "encode": times}, indent=1) + "\n")
    (out / "block_scalers.md").write_text(md)


if __name__ == "__main__":
    main()
