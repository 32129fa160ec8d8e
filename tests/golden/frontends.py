"""Golden parameters of both Horovod front ends: K steps of training on real ranks, every transport.

    python -m tests.golden.frontends        rewrite tests/golden/frontends_v1.json (2 and 4 real ranks)

The file was written by the commit before the exchange pipeline was refactored into one code path, so that
every later commit can show that the stock compressor and hvd_terngrad's optimizer still train to the same
bits. When shared block scalers went to 16 bits (docs/wire-format.md, section 12), the cases with shared block
scalers (blocks, blocks-summed, blocks-sharded, blocks-sharded-ternary, recommended-sharded) were rewritten;
every other case came out unchanged. Each entry is the SHA-256 of every parameter's bytes after STEPS steps,
in named order.

The bits must not depend on the CPU. In fp32, torch's matmuls, sums, normal sampler and init gave other last
bits on an Intel Xeon with AVX-512 than on the AMD EPYC with AVX2 the file had passed on, so the model draws its
inputs and weights in float64 and runs in float64, its gradients rounded to fp32 on their way back. The file
was rewritten for that change, and the exchange's code of the commit before it gives the same file. It also
passes with ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 DNNL_MAX_CPU_ISA=AVX2 (the vector paths of an AVX2 CPU); not
with ATEN_CPU_CAPABILITY=default, whose scalar SGD step rounds without a fused multiply-add.
tests/test_frontends.py holds real jobs and the in-process simulator to it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("frontends_v1.json")
STEPS = 4
COMMON = {"seed": 3, "min_numel": 256, "exclude": ("head.*",)}
BUCKET_BYTES = 4 * 2048  # several buckets
CASES = [  # (name, TernGrad options)
    ("allgather", {}),
    ("allgather-ef-noshare", {"error_feedback": True, "share_scaler": False, "clip": 0.0}),
    ("summed", {"transport": "summed"}),
    ("summed-int8", {"transport": "summed-int8"}),
    ("sharded", {"transport": "sharded"}),
    ("sharded-ternary", {"transport": "sharded-ternary"}),
    ("sharded-ternary-owner-ef", {"transport": "sharded-ternary", "owner_error_feedback": True,
                                  "error_feedback": True}),
    ("blocks", {"block_size": 64}),
    ("blocks-noshare-ef", {"block_size": 128, "share_scaler": False, "error_feedback": True}),
    ("blocks-summed", {"block_size": 64, "transport": "summed"}),
    ("blocks-sharded", {"block_size": 64, "transport": "sharded"}),
    ("blocks-sharded-ternary", {"block_size": 256, "transport": "sharded-ternary"}),
    ("recommended-sharded", {"block_size": 64, "clip": 0.0, "error_feedback": True, "transport": "sharded"}),
]
# The stock optimizer runs every case whose collective may start inside compress()
STOCK_CASES = [(name, o) for name, o in CASES if o.get("transport") != "summed-int8"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                                        torch.nn.ReLU(), torch.nn.Linear(48, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 5)  # excluded: a float pass-through, as the paper's classifier
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # torch's fp32 init draws other bits at other SIMD widths; float64's does not
            for m in (*self.body, self.head):
                for p in (m.parameters() if isinstance(m, torch.nn.Linear) else ()):
                    bound = m.in_features ** -0.5  # nn.Linear's own bound
                    p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64) * (2 * bound) - bound)

    def forward(self, x):
        # in float64, the gradients rounded to fp32 on their way back: fp32's matmuls and sums give other last
        # bits on other CPUs (MKL's kernels, ATen's vector width), and these bits are the test
        h = x.double()
        for m in (*self.body, self.head):
            h = torch.relu(h) if isinstance(m, torch.nn.ReLU) else \
                torch.nn.functional.linear(h, m.weight.double(), m.bias.double())
        return h


def loss(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    # uniform inputs: torch's normal sampler gives other bits at other SIMD widths
    x, y = torch.rand(16, 20, generator=g, dtype=torch.float64) * 4 - 2, torch.randint(0, 5, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def digest(params) -> list[str]:
    return [hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()[:32] for p in params]


def run_steps(model, opt, rank: int, steps: int) -> None:
    """`steps` training steps of `model` (a DDP model too) on this rank's batches (loss)."""
    for step in range(steps):
        opt.zero_grad()
        loss(model, rank, step).backward()
        opt.step()


def train(make_optimizer, rank: int) -> list[torch.Tensor]:
    model = Net()
    run_steps(model, make_optimizer(model), rank, STEPS)
    return [p.detach().clone() for p in model.parameters()]


def body_frontends(frontends=("optimizer", "stock")) -> dict:
    """One rank of a real job: {frontend: {case: digests}}."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)

    def optimizer(options):
        def make(model):
            tg = hvd_terngrad.TernGrad(**COMMON, **options)
            return hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                     named_parameters=model.named_parameters(), compression=tg,
                                                     bucket_bytes=BUCKET_BYTES)
        return make

    def stock(options):
        def make(model):
            tg = hvd_terngrad.TernGrad(model.named_parameters(), **COMMON, **options)
            return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=model.named_parameters(), compression=tg)
        return make

    out = {}
    if "optimizer" in frontends:
        out["optimizer"] = {name: digest(train(optimizer(o), hvd.rank())) for name, o in CASES}
    if "stock" in frontends:
        out["stock"] = {name: digest(train(stock(o), hvd.rank())) for name, o in STOCK_CASES}
    return out


def main() -> None:
    from tests.mpi_harness import run_ranks

    golden = {}
    for n in (2, 4):
        res = run_ranks("tests.golden.frontends:body_frontends", np=n, timeout=600)
        assert all(r == res[0] for r in res), f"the ranks of the {n}-rank job disagree"
        golden[str(n)] = res[0]
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
