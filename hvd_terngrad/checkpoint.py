"""What a checkpoint keeps of one rank's TernGrad (TernGrad.state_dict, TernGradState.state_dict): the step, which
keys every random draw, the error-feedback residuals, and what they are valid for (the options that change the
codes, the world size, the rank). Each rank saves its own: residuals differ between ranks."""
from __future__ import annotations

import warnings

from hvd_terngrad.coder import Coder
from hvd_terngrad.config import TernGradConfig

STATE_VERSION = 1  # of state_dict()


def coding_options(config: TernGradConfig) -> dict:
    """The options that change what is coded or what a residual means (not how fast, nor how long to wait)."""
    keep = ("clip", "share_scaler", "min_numel", "exclude", "seed", "error_feedback", "owner_error_feedback",
            "transport", "hierarchical", "block_size") + (("owner_clip",) if config.transport == "sharded-ternary"
                                                          else ())  # only sharded-ternary's owners draw
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in
            ((k, getattr(config, k)) for k in keep)}


def state_dict(coder: Coder) -> dict:
    """This rank's state: its step, its residuals and what they are valid for."""
    return {"version": STATE_VERSION, "step": coder.step, "rank": coder.rank, "size": coder.size,
            "options": coding_options(coder.config), "feedback": coder.feedback.state_dict()}


def load_state_dict(coder: Coder, state: dict) -> None:
    """Resume from state_dict(): the same step and residuals, so training goes on bit for bit. Options that change
    the codes must be the same (ValueError naming them); on another world size or rank the residuals belong to
    other ranks' gradients and are dropped, with a warning."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"hvd_terngrad: a TernGrad state of version {state.get('version')!r}; this version "
                         f"reads {STATE_VERSION}")
    mine = coding_options(coder.config)
    saved = dict(state["options"])
    if saved.get("transport") == "sharded-ternary":  # saved before owner_clip existed: owners clipped at clip
        saved.setdefault("owner_clip", saved.get("clip"))
    differ = sorted(k for k in mine.keys() | saved.keys() if mine.get(k) != saved.get(k))
    if differ:
        raise ValueError("hvd_terngrad: the TernGrad state was saved with other options ("
                         + ", ".join(f"{k}={saved.get(k)!r}, now {mine.get(k)!r}" for k in differ)
                         + f"), on rank {coder.rank}: load it with the same options, or start without it")
    coder.step = state["step"]
    coder.stats.current.step = state["step"]
    if (state["size"], state["rank"]) != (coder.size, coder.rank):
        warnings.warn(f"hvd_terngrad: the TernGrad state was saved by rank {state['rank']} of {state['size']}, "
                      f"loaded on rank {coder.rank} of {coder.size}: its error-feedback residuals are dropped",
                      stacklevel=3)
        return
    coder.feedback.load_state_dict(state["feedback"])
