"""How hvd_terngrad.DistributedOptimizer groups gradients into buckets; no Horovod, so that the performance
model plans the same buckets offline."""
from __future__ import annotations

DEFAULT_BUCKET_BYTES = 4 << 20


def plan_buckets(params: list[tuple[str, int, int]], cfg, bucket_bytes: int) -> tuple[list[list[int]], list[int]]:
    """How the optimizer groups parameters, from (name, numel, element size) in registration order: buckets
    of coded parameters in reverse registration order (the usual order of backward), each closed once it
    holds at least bucket_bytes, and the parameters that stay in float. Returns indices into `params`."""
    buckets, cur, cur_bytes, floats = [], [], 0, []
    for i in reversed(range(len(params))):
        name, numel, itemsize = params[i]
        if not cfg.compresses(name, numel):
            floats.append(i)
            continue
        cur.append(i)
        cur_bytes += numel * itemsize
        if cur_bytes >= bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)
    return buckets, floats
