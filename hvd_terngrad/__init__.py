"""hvd_terngrad: TernGrad (Wen et al., NeurIPS 2017) for Horovod and PyTorch.

    import horovod.torch as hvd, hvd_terngrad
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_terngrad.TernGrad(model.named_parameters()))
    # or, with buckets, overlap and skip-on-NaN:
    opt = hvd_terngrad.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The codec (hvd_terngrad.codec), the options (TernGradConfig), the exchange pipeline (hvd_terngrad.pipeline)
and its in-process collectives import without Horovod; TernGrad and DistributedOptimizer import horovod.torch
when first used.
"""
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.errors import CollectiveTimeoutError, NonFiniteGradientError, PayloadMismatchError, TernGradError
from hvd_terngrad.pipeline import Pipeline
from hvd_terngrad.stats import StepStats

__version__ = "0.1.0"
__all__ = ["TernGrad", "DistributedOptimizer", "TernGradConfig", "Pipeline", "StepStats", "TernGradError",
           "NonFiniteGradientError", "PayloadMismatchError", "CollectiveTimeoutError"]


def __getattr__(name):
    if name == "TernGrad":
        from hvd_terngrad.compression import TernGrad

        return TernGrad
    if name == "DistributedOptimizer":
        from hvd_terngrad.optimizer import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'hvd_terngrad' has no attribute {name!r}")
