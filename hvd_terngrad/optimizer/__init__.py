"""hvd_terngrad.DistributedOptimizer: TernGrad with buckets and overlap, the signature of hvd.DistributedOptimizer.

What it does that the stock optimizer with compression=TernGrad(...) cannot:
- Buckets: coded gradients are grouped (in backward order) into buckets of about `bucket_bytes`; a
  bucket shares its scalers in one Max allreduce and sends its codes in one allgather, so a model with many
  small tensors pays one latency per bucket, not two per tensor.
- No blocking in backward: the scaler allreduce is asynchronous; later hooks poll it and start the
  bucket's allgather as soon as it is done, overlapping coding and communication with the backward pass.
- It owns the step, so on_nonfinite="skip" can skip the update on every rank.

A sparse gradient (an nn.Embedding(sparse=True), say) passes through uncoded, averaged as Horovod averages
it (an allgather of its indices and values), and leaves its bucket to the dense tensors; with
sparse_as_dense=True it is coded as a dense tensor and handed back sparse, as Horovod does.

Results equal the stock path bit for bit for the same seed and names (the codes of a tensor depend only on
seed, step, rank, tensor name and the shared scaler). With one rank, like the stock optimizer, it does not
touch the gradients.

Modules: this one (DistributedOptimizer, the step protocol, the verdict on non-finite averages), exchange
(Exchange: what becomes of each gradient, bucket by bucket) and uncoded (Uncoded: the float and sparse averages).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.finite import nonfinite_average
from hvd_terngrad.optimizer.exchange import Exchange
from hvd_terngrad.session import Session


class _StepProtocol:
    """The step protocol of hvd.DistributedOptimizer, as Horovod documents it: step() synchronizes unless inside
    skip_synchronize() (after an explicit synchronize(), for clipping or AMP's unscale_), skips a step the
    exchange marked, and zero_grad() between backward and step is an error. Mixed into the optimizer's class."""

    @contextmanager
    def skip_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        if self._skip_next_step:
            self._skip_next_step = False
            return None
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._ex.busy:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause a "
                                 "race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


class _TernGradOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, process_set,
                 bucket_bytes, sparse_as_dense):
        super(self.__class__, self).__init__(params)
        all_params = [p for g in self.param_groups for p in g["params"]]
        named = _checked_names(named_parameters, self.param_groups, all_params)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")

        # its own session (in bucket order on every rank: a blocking transport may be chosen), from the options
        # of the TernGrad compressor, which then reports the optimizer's stats and state (TernGrad.attach)
        if compression is None:
            session = Session.horovod(TernGradConfig(), process_set)
        else:
            session = Session.horovod(*compression.bind(named, process_set))
            compression.attach(session)
        in_opt = {id(p) for p in all_params}
        self._ex = Exchange(session, [(n, p) for n, p in named if id(p) in in_opt and p.requires_grad],
                             bucket_bytes, sparse_as_dense)
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for _, p in self._ex.named}
        self._skip_next_step = False
        self._synchronized = False
        self._should_synchronize = True
        self._grad_accs = []
        if self._ex.world.size > 1:
            self._register_hooks()

    def add_param_group(self, param_group):
        """torch's add_param_group; its parameters are averaged from the next backward on, named by their place
        (allreduce.noname.<group>.<index>), and the buckets are planned again. (The stock hvd optimizer
        registers its hooks only when built, and leaves such parameters unaveraged.)"""
        super(self.__class__, self).add_param_group(param_group)
        if not hasattr(self, "_ex"):  # the groups torch's constructor adds: __init__ names them
            return
        if self._ex.busy:
            raise AssertionError("add_param_group() between backward and step(): add groups between steps")
        k = len(self.param_groups) - 1
        new = [(f"allreduce.noname.{k}.{j}", p) for j, p in enumerate(self.param_groups[k]["params"])
               if p.requires_grad and p not in self._ex.name_of]
        self._ex.add(new)
        for _, p in new:
            self._delay[p] = self.backward_passes_per_step
        if self._ex.world.size > 1:
            self._register_hooks([p for _, p in new])

    def _register_hooks(self, params=None):
        for p in params if params is not None else [p for _, p in self._ex.named]:
            p_tmp = p.expand_as(p)
            grad_acc = p_tmp.grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_hook(p))
            self._grad_accs.append(grad_acc)

    def _make_hook(self, p):
        def hook(*_):
            if self._delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._delay[p] -= 1
            if self._delay[p] == 0:
                self._ex.ready(p)
                self._ex.progress()
        return hook

    def synchronize(self):
        ex = self._ex
        if ex.world.size <= 1:
            self._synchronized = True
            return
        try:
            bad, float_bad = ex.finish()
        finally:
            ex.start_step()
            self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)
            self._synchronized = True
        deciding = ex.pipe.plan.deciding
        try:
            self._skip_next_step = _skips(ex.cfg, ex.pipe, bad, float_bad, ex.world.rank)
        finally:
            ex.pipe.next_step()
            if deciding and not ex.pipe.plan.deciding:
                # the verdict's step codes every group: a trial's buffers go (half or all of a gradient's bytes
                # each), and a kept plan makes its own again on its first step
                ex.kept.clear()


def _skips(cfg, pipe, bad: list, float_bad: list[tuple[str, int]], rank: int) -> bool:
    """A step's verdict on non-finite averages (the same on every rank): whether to skip it (on_nonfinite=
    "skip"); with "propagate" the averages are already NaN, for AMP's GradScaler to find; else
    NonFiniteGradientError naming the tensor (and the rank, where known)."""
    if not (bad or float_bad):
        return False
    if cfg.on_nonfinite == "skip":
        pipe.stats.current.skipped = True
        return True
    if cfg.on_nonfinite == "propagate":  # the pipeline made those averages NaN
        return False
    pipe.coder.raise_nonfinite(bad)
    raise nonfinite_average(*float_bad[0], pipe.step, rank)


def _checked_names(named_parameters, param_groups, all_params) -> list:
    """(name, parameter) for every parameter, checked as Horovod checks them; made up where not given."""
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(x, tuple) for x in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                             "produced by model.named_parameters()")
    else:
        named = [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(param_groups)
                 for j, v in enumerate(g["params"])]
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    named_ids = {id(v) for _, v in named}
    if any(id(p) not in named_ids for p in all_params):
        raise ValueError("named_parameters was specified, but one or more model parameters were not named")
    return named


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set,
                         bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Wrap `optimizer` so that gradients are averaged across ranks as TernGrad ternary codes.

    Same signature as hvd.DistributedOptimizer, less what TernGrad replaces. The optimizer builds its own session
    (hvd_terngrad.session) from the compressor's options; the compressor then reports its stats and state.

    Args:
        optimizer: the torch optimizer to wrap; its class is subclassed, as Horovod does.
        named_parameters: (name, parameter) of every parameter, usually model.named_parameters(); names key the
            codes, exclude= and the errors (made up by position where not given).
        compression: an hvd_terngrad.TernGrad with the options (default: the paper's, TernGradConfig()).
        backward_passes_per_step: backward passes a step accumulates before the exchange (>= 1).
        op: hvd.Average only.
        gradient_predivide_factor: 1.0 only (TernGrad decodes the exact average).
        num_groups: 0 only; groups: None only (bucket_bytes replaces both).
        sparse_as_dense: code sparse gradients as dense tensors and hand them back sparse (else they pass
            through uncoded, averaged as Horovod averages them).
        process_set: the Horovod process set to average over (the compressor's must be the same).
        bucket_bytes: the dense bytes of coded gradient per bucket (buckets.plan_buckets).

    Returns:
        The wrapped optimizer: step(), zero_grad(), synchronize() and skip_synchronize() as Horovod's.

    Raises:
        ValueError: a compression other than TernGrad, op, gradient_predivide_factor, num_groups or groups
            other than the above, bucket_bytes < 1, duplicate or missing parameter names, or a compressor bound
            to another process set.
    """
    if compression is not None and not (isinstance(getattr(compression, "config", None), TernGradConfig)
                                        and callable(getattr(compression, "attach", None))):
        raise ValueError("hvd_terngrad.DistributedOptimizer takes compression=hvd_terngrad.TernGrad(...); for "
                         f"{type(compression).__name__} use hvd.DistributedOptimizer")
    if op != hvd.Average:
        raise ValueError("hvd_terngrad.DistributedOptimizer averages gradients (op=hvd.Average) only")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor must be 1.0: TernGrad decodes the exact average")
    if num_groups or groups:
        raise ValueError("num_groups/groups are not used: hvd_terngrad buckets coded tensors itself (bucket_bytes=)")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    protocol = {k: v for k, v in _StepProtocol.__dict__.items() if k not in ("__dict__", "__weakref__")}
    methods = {**protocol, **_TernGradOptimizer.__dict__}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, process_set,
               bucket_bytes, sparse_as_dense)
