"""transport="summed" and "summed-int8": with a shared scaler every rank's codes are integers on one scale,
so their sums travel in one Sum allreduce, at a cost that does not grow with N. An item's offset is its first
element in the group's values.
"""
from __future__ import annotations

import torch

import hvd_terngrad.codec as codec
from hvd_terngrad.commcost import allreduce_bytes, allreduce_time
from hvd_terngrad.errors import PayloadMismatchError
from hvd_terngrad.transports.base import Transport, destination


class Summed(Transport):
    """The code sums in one fp16 Sum allreduce, exact for N <= 2048, about 4n bytes per worker whatever N."""

    name = "summed"
    collective = "allreduce_fp16"
    max_workers = 2048
    dtype = torch.float16

    def encode(self, coder, items):
        """Every code as a value in {-1, 0, 1} (fp16 or int8), the items back to back."""
        with coder.stats.timed("encode"):
            dev = items[0].flat.device if items else torch.device("cpu")
            values = torch.empty(sum(it.numel for it in items), dtype=self.dtype, device=dev)
            off = 0
            for it in items:
                it.offset = off
                b = coder.code_values(it)
                if b is None:
                    values[off: off + it.numel].zero_()
                else:
                    values[off: off + it.numel].copy_(b)
                off += it.numel
        for it in items:
            coder.stats.add_coded(it.numel * values.element_size(), it.numel * it.flat.element_size(), coder.size,
                                  scaler_bytes=coder.scaler_bytes(it))
        return values

    def start(self, comm, payload, key):
        return comm.sum_async_(payload, name=f"terngrad.sum.{key}")

    def finish(self, comm, handle, what):
        return comm.wait(handle, f"the code-sum allreduce of {what}")

    def decode(self, coder, items, received, outs=None):
        """The averages from the summed codes: fl32((sum of codes) * fl32(s / N)), as the allgather decode."""
        with coder.stats.timed("decode"):
            if received.numel() != sum(it.numel for it in items):
                raise PayloadMismatchError(
                    f"hvd_terngrad: received {received.numel()} code sums for tensors starting with "
                    f"{items[0].name!r}, expected {sum(it.numel for it in items)} (rank {coder.rank})")
            out = []
            for i, it in enumerate(items):
                dst = destination(outs, i)
                if dst is None:
                    dst = torch.empty(it.numel, dtype=torch.float32, device=received.device)
                dst.copy_(received[it.offset: it.offset + it.numel])  # exact: integers |v| <= N
                if it.scalers is not None:
                    out.append(codec.scale_blocks_(dst, it.scalers / coder.size, coder.config.block_size))
                else:
                    out.append(dst.mul_(torch.tensor(it.scaler, dtype=torch.float32, device=received.device)
                                        / coder.size))
        return out

    def submitted_bytes(self, numel, tensors):
        return 2 * numel

    def seconds(self, numel, n_workers, link):
        return allreduce_time(2 * numel, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(2 * numel, n_workers)


class SummedInt8(Summed):
    """The sums as int8: half the fp16 bytes, N <= 127. Horovod's allreduce takes no int8, so there it is one
    blocking mpi4py call, and the hvd_terngrad optimizer only (made in bucket order when the step waits)."""

    name = "summed-int8"
    stock_ok = False
    blocking = True
    collective = "allreduce_int8"
    max_workers = 127
    dtype = torch.int8

    def start(self, comm, payload, key):
        return comm.int8_sum_async_(payload, name=f"terngrad.sum8.{key}")

    def finish(self, comm, handle, what):
        return comm.wait(handle, f"the int8 code-sum allreduce of {what}")

    def submitted_bytes(self, numel, tensors):
        return numel

    def seconds(self, numel, n_workers, link):
        return allreduce_time(numel, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(numel, n_workers)
