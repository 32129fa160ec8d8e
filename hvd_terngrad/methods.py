"""One vocabulary for how gradients travel, used by the main job and every benchmark: a method name, the
optimizer it builds, and what its exchange costs on a link by commcost's formulas (comm_seconds).

    local                    no gradient exchange: each worker steps on its own gradients. Not a way to
                             train; the throughput ceiling of every method on the same cluster
    fp32                     plain Horovod
    fp16                     Horovod's Compression.fp16
    terngrad                 hvd_terngrad.DistributedOptimizer, paper defaults, allgather transport
    terngrad:<modifier>...   with modifiers, in any order:
        allgather, summed, summed-int8,         the transport (hvd_terngrad.transports)
        sharded, sharded-ternary, auto
        stock                                   hvd.DistributedOptimizer(compression=TernGrad(...)) instead
        noclip, noshare, ef                     clip=0, share_scaler=False, error_feedback=True
        hier                                    hierarchical=True (float inside nodes, codes between them)
        block<k>                                block_size=k, e.g. block256 (one scaler per k elements)
    ddp:fp32, ddp:fp16, ddp:bf16             PyTorch DDP (torch.distributed, no Horovod in the exchange): its
    ddp:powersgd, ddp:powersgd<r>            default allreduce, fp16_compress_hook, bf16_compress_hook,
                                             powerSGD_hook (rank r, default 1; the hook's warm-up of 1000
                                             iterations cut to 2), run bucket after bucket in launch order
                                             (hvd_terngrad.ddp.InLaunchOrder: its chained callbacks
                                             abort gloo jobs otherwise)
    ddp:terngrad[:<modifier>...]             DDP with hvd_terngrad.ddp.terngrad_hook (no stock)

`parse_method("terngrad:stock:summed").name` is the canonical spelling: modifiers in the order above, the
default transport left out. No Horovod is imported until an optimizer is built.
"""
from __future__ import annotations

from dataclasses import dataclass

from hvd_terngrad.codec import check_block_size
from hvd_terngrad.commcost import Link, allgather_time, allreduce_time
from hvd_terngrad.config import TRANSPORTS, TernGradConfig
from hvd_terngrad.transports import TRANSPORTS as TRANSPORT_TABLE
from hvd_terngrad.wire import HEADER_SIZE, SCALER_ENTRY_BYTES

COMPRESSIONS = ("local", "fp32", "fp16", "terngrad")
# PowerSGD allreduces plainly over this share of a training's steps first, as torch's documentation advises
# for start_powerSGD_iter (the time-to-accuracy benchmark and the fidelity suite)
POWERSGD_WARMUP = 0.1


def powersgd_start(total_steps: int) -> int:
    """start_powerSGD_iter for a training of `total_steps` steps (the hook needs at least 2)."""
    return max(2, round(POWERSGD_WARMUP * total_steps))

DDP_COMPRESSIONS = ("fp32", "fp16", "bf16", "powersgd", "terngrad")
OPTIONS = {"noclip": ("clip", 0.0), "noshare": ("share_scaler", False), "ef": ("error_feedback", True),
           "hier": ("hierarchical", True)}


@dataclass(frozen=True)
class Method:
    compression: str = "terngrad"
    transport: str = "allgather"
    stock: bool = False  # TernGrad through the stock hvd.DistributedOptimizer
    options: tuple[str, ...] = ()  # keys of OPTIONS, in their order
    block_size: int | None = None
    ddp: bool = False  # the exchange of PyTorch DDP (torch.distributed), not Horovod's
    rank: int = 1  # PowerSGD's matrix approximation rank

    @property
    def name(self) -> str:
        prefix = "ddp:" if self.ddp else ""
        if self.compression == "powersgd" and self.rank != 1:
            return f"{prefix}powersgd{self.rank}"
        if self.compression != "terngrad":
            return prefix + self.compression
        mods = ([self.transport] if self.transport != "allgather" else []) + (["stock"] if self.stock else [])
        return prefix + ":".join(["terngrad", *mods, *self.options,
                                  *([f"block{self.block_size}"] if self.block_size else [])])

    @property
    def optimizer(self) -> str:
        if self.ddp:
            return "ddp"
        if self.compression == "local":
            return "none"
        return "stock" if self.stock or self.compression != "terngrad" else "hvd_terngrad"

    def terngrad_options(self) -> dict:
        extra = {"block_size": self.block_size} if self.block_size else {}
        return dict([OPTIONS[o] for o in self.options], transport=self.transport, **extra)


def parse_method(text: str) -> Method:
    """A Method from its name; ValueError naming what is allowed otherwise."""
    if text.strip().startswith("ddp:"):
        return _parse_ddp(text.strip()[4:], text)
    base, *mods = text.strip().split(":")
    if base not in COMPRESSIONS:
        raise ValueError(f"unknown method {text!r}: it starts with one of {', '.join(COMPRESSIONS)}")
    if base != "terngrad":
        if mods:
            raise ValueError(f"method {text!r}: only terngrad takes modifiers")
        return Method(base)
    transports = [m for m in mods if m in TRANSPORTS]
    blocks = [m for m in mods if m.startswith("block") and m[5:].isdigit()]
    unknown = [m for m in mods if m not in TRANSPORTS and m != "stock" and m not in OPTIONS and m not in blocks]
    if unknown or len(transports) > 1 or len(blocks) > 1 or len(set(mods)) != len(mods):
        raise ValueError(f"method {text!r}: modifiers are one transport of {', '.join(TRANSPORTS)}, 'stock', "
                         f"any of {', '.join(OPTIONS)}, and one block<k>, each once")
    block_size = int(blocks[0][5:]) if blocks else None
    if block_size is not None:
        check_block_size(block_size)
    return Method("terngrad", transports[0] if transports else "allgather", "stock" in mods,
                  tuple(o for o in OPTIONS if o in mods), block_size)


def _parse_ddp(rest: str, text: str) -> Method:
    base = rest.split(":")[0]
    if base.startswith("powersgd") and base[8:].isdigit() and int(base[8:]) > 0:
        if rest != base:
            raise ValueError(f"method {text!r}: only ddp:terngrad takes modifiers")
        return Method("powersgd", ddp=True, rank=int(base[8:]))
    if base not in DDP_COMPRESSIONS:
        raise ValueError(f"method {text!r}: ddp: takes one of {', '.join(DDP_COMPRESSIONS)}")
    if base != "terngrad":
        if rest != base:
            raise ValueError(f"method {text!r}: only ddp:terngrad takes modifiers")
        return Method(base, ddp=True)
    m = parse_method(rest)
    if m.stock:
        raise ValueError(f"method {text!r}: 'stock' is Horovod's optimizer; DDP has its hook")
    return Method("terngrad", m.transport, False, m.options, m.block_size, ddp=True)


def build_ddp(method: Method, model, base_lr: float, seed: int = 0, momentum: float = 0.0, exclude=(),
              powersgd_start: int = 2, optimizer=None):
    """(DDP module, SGD optimizer over it, the TernGrad hook's state or None) for a ddp: method; torch.distributed
    must be initialized. exclude: TernGrad's (parameter-name patterns left in float); powersgd_start: the
    iteration at which PowerSGD starts compressing (plain allreduce before); optimizer: a function of the
    parameters that makes the optimizer instead of SGD(base_lr, momentum)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from hvd_terngrad.ddp import InLaunchOrder, bf16_hook, in_launch_order

    module = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if method.compression == "fp16":
        module.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.compression == "bf16":
        module.register_comm_hook(None, bf16_hook)
    elif method.compression == "powersgd":
        psgd = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=method.rank,
                                           start_powerSGD_iter=powersgd_start, random_seed=seed)
        module.register_comm_hook(InLaunchOrder(powerSGD_hook.powerSGD_hook, psgd), in_launch_order)
    elif method.compression == "terngrad":
        from hvd_terngrad.ddp import TernGradState

        state = TernGradState(model.named_parameters(), seed=seed, exclude=exclude, **method.terngrad_options())
        state.register(module)
    opt = (optimizer(module.parameters()) if optimizer else
           torch.optim.SGD(module.parameters(), lr=base_lr, momentum=momentum))
    return module, opt, state


def build_optimizer(method: Method, model, base, seed: int = 0, exclude=(), **options):
    """(Horovod optimizer wrapping `base`, the TernGrad compressor or None) for `method`; exclude: TernGrad's
    (parameter-name patterns left in float); options: more of TernGrad's, for hvd_terngrad's optimizer."""
    import horovod.torch as hvd

    import hvd_terngrad

    if method.compression == "local":
        return _Lockstep(base), None
    named = list(model.named_parameters())
    if method.compression == "fp32":
        return hvd.DistributedOptimizer(base, named_parameters=named), None
    if method.compression == "fp16":
        return hvd.DistributedOptimizer(base, named_parameters=named, compression=hvd.Compression.fp16), None
    if method.stock:
        tg = hvd_terngrad.TernGrad(named, seed=seed, exclude=exclude, **method.terngrad_options())
        return hvd.DistributedOptimizer(base, named_parameters=named, compression=tg), tg
    tg = hvd_terngrad.TernGrad(seed=seed, exclude=exclude, **method.terngrad_options(), **options)
    return hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg), tg


class _Lockstep:
    """`local`: the base optimizer, and after each step a one-element allreduce that keeps the ranks in step,
    as synchronous training does. Without it the ranks drift apart, and where nodes share cores rank 0's
    timing would count steps taken while others idle."""

    def __init__(self, base):
        self.base = base

    def zero_grad(self):
        self.base.zero_grad()

    def step(self):
        import horovod.torch as hvd
        import torch

        self.base.step()
        hvd.allreduce(torch.zeros(1), name="local.lockstep", op=hvd.Sum)


def target_from(fp32: float, lower_is_better: bool = False) -> float:
    """What counts as FP32's quality: its metric less 0.5 pp (accuracy, %), or plus 1% (bits per character).
    The time-to-accuracy benchmark's target and the main job's (examples/train_digits.py)."""
    return fp32 * 1.01 if lower_is_better else fp32 - 0.5


# ------------------------------------------------------------------------------------------
# What a method's exchange costs: the performance model's (benchmarks/perf_model.py) and the main job's estimate
@dataclass(frozen=True)
class Split:
    """How a model's gradient divides under TernGrad's default policy."""

    coded: int  # elements TernGrad codes
    tensors: int  # coded tensors
    floats: int  # elements that pass through in float

    @property
    def total(self) -> int:
        return self.coded + self.floats


def split_of(model) -> Split:
    """A model's gradient under TernGrad's default policy (TernGradConfig().compresses)."""
    cfg = TernGradConfig()
    coded = tensors = floats = 0
    for name, p in model.named_parameters():
        if cfg.compresses(name, p.numel()):
            coded, tensors = coded + p.numel(), tensors + 1
        else:
            floats += p.numel()
    return Split(coded, tensors, floats)


def comm_seconds(method: str, s: Split, n: int, link: Link, hier: tuple[int, Link] | None = None) -> float:
    """Communication per step. hier = (GPUs per node, intra-node link): reduce inside nodes over the fast
    link, exchange between nodes over `link`, broadcast back inside nodes."""
    if n <= 1:
        return 0.0
    g, intra = hier if hier else (1, link)
    g = min(g, n)
    m = max(1, n // g)  # nodes
    if method in ("fp32", "fp16"):
        width = 4 if method == "fp32" else 2
        inside = 2 * allreduce_time(width * s.total, g, intra) if g > 1 else 0.0
        return inside + allreduce_time(width * s.total, m, link)
    floats = allreduce_time(4 * s.floats, n, link) if s.floats else 0.0
    scalers = allreduce_time(SCALER_ENTRY_BYTES * s.tensors, n, link)
    if method == "terngrad":  # allgather: nodes exchange the codes of all their GPUs
        inside = allgather_time(s.coded / 4, g, intra) if g > 1 else 0.0
        return inside + allgather_time(g * (s.coded / 4 + HEADER_SIZE * s.tensors), m, link) + scalers + floats
    if method in ("terngrad:summed", "terngrad:summed-int8"):
        width = 2 if method == "terngrad:summed" else 1
        inside = 2 * allreduce_time(width * s.coded, g, intra) if g > 1 else 0.0
        return inside + allreduce_time(width * s.coded, m, link) + scalers + floats
    transport, _, mode = method.partition(":")[2].partition(":")
    if transport in ("sharded", "sharded-ternary") and mode in ("", "hier"):
        t = TRANSPORT_TABLE[transport]
        if mode == "hier" and g > 1:  # float average inside nodes, the transport between nodes, broadcast back
            # (hvd_terngrad/hierarchy.py; which local rank codes a bucket does not change a node's bytes)
            return (2 * allreduce_time(4 * s.total, g, intra) + t.seconds(s.coded, m, link)
                    + allreduce_time(SCALER_ENTRY_BYTES * s.tensors, m, link)
                    + (allreduce_time(4 * s.floats, m, link) if s.floats else 0.0))
        # flat: every GPU a shard owner; a node's GPUs share its link (in one node, the fast one)
        shared = intra if m == 1 else Link(link.bandwidth / g, link.latency)
        return t.seconds(s.coded, n, shared) + scalers + floats
    raise ValueError(f"unknown method {method!r}")
