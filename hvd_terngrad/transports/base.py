"""What every transport is: how one group of coded tensors travels between ranks, in four steps, the way a
compressed-communication hook is (GRACE's Communicator, PyTorch's ddp_comm_hooks):

    payload = t.encode(coder, items)             this rank's codes, in the transport's own layout
    handle = t.start(comm, payload, key)         a non-blocking collective (comm: a collectives.Collectives)
    t.advance(comm, handle, what, block)         a transport of two collectives starts its second
    received = t.finish(comm, handle, what)      wait, at most timeout_s
    averages = t.decode(coder, items, received, outs)

plus what the cost model needs: `seconds(numel, n, link)` on a link of commcost's, the calibration's name for
its collective, and the bytes each worker submits and sends. Each transport decides what its items' `offset`
means (bytes of a record, bytes of a code stream, or elements).
"""
from __future__ import annotations

import torch

from hvd_terngrad.commcost import Link

# A record's codes are padded to a multiple of 8 bytes: at most 7 a tensor, counted as 8.
RECORD_PADDING_BYTES = 8


class Transport:
    name = ""
    needs_shared_scaler = True  # codes summed across ranks must share one scale
    stock_ok = True  # its collective can start inside compress() of the stock optimizer
    blocking = False  # its collective is one blocking call, made by finish() in the same order on every rank
    collective = ""  # the calibration's name of its collective (benchmarks/calibrate.py)
    reply_collective = ""  # of its second collective, started by advance(), if it has one
    max_workers = 1 << 30  # beyond this N the sums would not be exact
    # transport="auto" may pick it: its average is the allgather's bit for bit, and its cost model is validated
    # on the emulated clusters (docs/performance-model.md)
    auto_ok = True

    def encode(self, coder, items) -> torch.Tensor:
        raise NotImplementedError

    def start(self, comm, payload: torch.Tensor, key: str):
        raise NotImplementedError

    def advance(self, comm, handle, what: str, block: bool) -> bool:
        """Move a transport of several collectives on to its next one, once the current one is done (block:
        wait for it, at most timeout_s); whether it did. Called from backward hooks and before the waits of a
        step, so that a bucket's second collective starts while others still run. One collective: nothing."""
        return False

    def finish(self, comm, handle, what: str) -> torch.Tensor:
        return comm.wait(handle, f"the code {self.name} of {what}")

    def decode(self, coder, items, received: torch.Tensor, outs=None) -> list[torch.Tensor]:
        raise NotImplementedError

    def submitted_bytes(self, numel: int, tensors: int) -> float:
        """Bytes one worker hands its collective for `tensors` tensors of `numel` elements in all."""
        raise NotImplementedError

    def seconds(self, numel: int, n_workers: int, link: Link) -> float:
        """Seconds to exchange one coded tensor of `numel` elements (scaler sharing not included)."""
        raise NotImplementedError

    def wire_bytes(self, numel: int, tensors: int, n_workers: int) -> float:
        """Bytes one worker sends for `tensors` tensors of `numel` coded elements in all, ring algorithms."""
        raise NotImplementedError


def destination(outs, i: int) -> torch.Tensor | None:
    """The caller's destination of item i, or None (decode allocates)."""
    return outs[i] if outs else None
