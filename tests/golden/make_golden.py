"""Regenerate the golden vectors from the torch reference (only when the wire format changes).

    python -m tests.golden.make_golden      # codec_v1.json (sections 1-6), sharded_v1.json (sections 10-11),
                                            # codec_v2.json (section 12, block scalers),
                                            # feedback_v1.json (section 13, error feedback)
"""
import json
import math
from pathlib import Path

import torch

from hvd_terngrad.codec import reference

CASES = [
    # name, n, dtype, scaler, seed, step, rank, tensor_id
    ("f32_n13", 13, "float32", 0.9, 0, 0, 0, 0),
    ("f32_n64_clip", 64, "float32", 0.5, 42, 7, 1, 0xDEADBEEF),
    ("f32_n1000", 1000, "float32", 0.8, 2**63 + 12345, 2**32 - 1, 65535, 123456789),
    ("f64_n37", 37, "float64", 0.7, 7, 3, 2, 99),
    ("f16_n50", 50, "float16", 0.6, 9, 1, 3, 5),
    ("bf16_n77", 77, "bfloat16", 0.75, 11, 2, 4, 6),
    ("zeros_n9", 9, "float32", 0.0, 1, 1, 1, 1),
]


def golden_input(n: int, dtype: str) -> torch.Tensor:
    """Deterministic, platform-independent input: a sine ramp with a few large values."""
    vals = [math.sin(0.7 * i + 0.3) * (1.5 if i % 11 == 0 else 0.6) for i in range(n)]
    if n == 9:
        vals = [0.0] * n
    return torch.tensor(vals, dtype=torch.float64).to(getattr(torch, dtype))


def main():
    out = {"wire_format_version": 1, "cases": []}
    for name, n, dtype, scaler, seed, step, rank, tid in CASES:
        x = golden_input(n, dtype)
        packed = reference.ternarize_pack(x, scaler, seed, step, rank, tid)
        mean, std, absmax, nonfinite = reference.moments(x)
        out["cases"].append({"name": name, "n": n, "dtype": dtype, "scaler": scaler, "seed": seed, "step": step,
                             "rank": rank, "tensor_id": tid, "packed_hex": bytes(packed.tolist()).hex(),
                             "stats": [mean, std, absmax, nonfinite]})
    path = Path(__file__).with_name("codec_v1.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


# Sharded transports: a stream of three tensors (numel 13, 64, 5) per rank, for N = 3, 8 and 130 ranks
# (4-, 8- and 16-bit sums), each rank's codes drawn from golden inputs with its own rank in the key.
SHARDED_NUMELS = (13, 64, 5)
SHARDED_RANKS = (3, 8, 130)


def sharded_stream(nranks: int, rank: int) -> torch.Tensor:
    parts = [reference.ternarize_pack(golden_input(n, "float32"), 0.9, 17, 4, rank, 100 + t)
             for t, n in enumerate(SHARDED_NUMELS)]
    stream = torch.cat(parts)
    pad = (-stream.numel()) % nranks
    return torch.cat([stream, stream.new_zeros(pad)])


def sharded_cases() -> list[dict]:
    cases = []
    for n in SHARDED_RANKS:
        streams = [sharded_stream(n, r) for r in range(n)]
        shard = streams[0].numel() // n
        replies = []
        for j in range(n):
            sums, _ = reference.sum_shards(torch.stack([s[j * shard:(j + 1) * shard] for s in streams]))
            replies.append(reference.pack_sums(sums, n))
        cases.append({"nranks": n, "shard_bytes": shard, "sums_hex": bytes(torch.cat(replies).tolist()).hex()})
    return cases


def main_sharded():
    path = Path(__file__).with_name("sharded_v1.json")
    path.write_text(json.dumps({"wire_format_version": 1, "numels": SHARDED_NUMELS, "scaler": 0.9, "seed": 17,
                                "step": 4, "cases": sharded_cases()}, indent=1) + "\n")
    print(f"wrote {path}")


# Version 2 (block scalers): codes with one scaler per block, the block scalers from the rule of
# TernGradConfig.block_scalers (c = 2.5, or clip 0), and a record with and without a shared scaler.
BLOCK_CASES = [
    # name, n, dtype, block_size, clip, seed, step, rank, tensor_id
    ("f32_n1000_b64", 1000, "float32", 64, 2.5, 3, 9, 1, 0xC0FFEE),
    ("f32_n300_b256_noclip", 300, "float32", 256, 0.0, 2**63 + 5, 2**32 - 1, 65535, 7),
    ("f64_n200_b64", 200, "float64", 64, 2.5, 8, 1, 2, 8),
    ("f16_n130_b64", 130, "float16", 64, 2.5, 9, 2, 3, 9),
    ("bf16_n77_b64", 77, "bfloat16", 64, 2.5, 10, 3, 4, 10),
]


def block_input(n: int, dtype: str) -> torch.Tensor:
    """A golden input whose magnitude falls block by block, where block scalers differ from a tensor's."""
    ramp = torch.tensor([1.0 / (1 + i // 32) for i in range(n)], dtype=torch.float64)
    return (golden_input(n, "float64") * ramp).to(getattr(torch, dtype))


def block_case(case: dict):
    """(x, fp32 block scalers, block_size, RngKey) of a codec_v2.json case."""
    from hvd_terngrad import TernGradConfig, codec

    x = block_input(case["n"], case["dtype"])
    block = case["block_size"]
    cfg = TernGradConfig(clip=case["clip"], block_size=block)
    scalers = cfg.block_scalers(codec.Moments(*reference.moments(x)), reference.block_absmax(x, block))
    return x, scalers, block, codec.RngKey(case["seed"], case["step"], case["rank"], case["tensor_id"])


def block_record(case: dict, shared: bool) -> bytes:
    """The version-2 record of a case's tensor (tag 0x01020304), step 5."""
    from hvd_terngrad import wire

    x, scalers, block, key = block_case(case)
    n = x.numel()
    codes = reference.ternarize_pack_blocks(x, scalers, block, key.seed, key.step, key.rank, key.tensor_id)
    rec = bytearray(wire.record_size(n, block, shared))
    rec[:wire.HEADER_SIZE] = wire.Header(wire.FLAG_SHARED if shared else 0, 0x01020304, n, 0.0, 5, block).pack()
    off = wire.HEADER_SIZE
    if not shared:
        rec[off: off + 4 * scalers.numel()] = scalers.numpy().astype("<f4").tobytes()
        off += wire.block_scalers_size(n, block)
    rec[off: off + codes.numel()] = bytes(codes.tolist())
    return bytes(rec)


def main_blocks():
    cases = []
    for name, n, dtype, block, clip, seed, step, rank, tid in BLOCK_CASES:
        case = {"name": name, "n": n, "dtype": dtype, "block_size": block, "clip": clip, "seed": seed,
                "step": step, "rank": rank, "tensor_id": tid}
        x, scalers, _, key = block_case(case)
        packed = reference.ternarize_pack_blocks(x, scalers, block, seed, step, rank, tid)
        case.update(scalers_hex=scalers.numpy().astype("<f4").tobytes().hex(),
                    packed_hex=bytes(packed.tolist()).hex(),
                    record_shared_hex=block_record(case, True).hex(),
                    record_own_hex=block_record(case, False).hex())
        cases.append(case)
    path = Path(__file__).with_name("codec_v2.json")
    path.write_text(json.dumps({"wire_format_version": 2, "cases": cases}, indent=1) + "\n")
    print(f"wrote {path}")


# Error feedback: the coded tensor g + r and the residual left, for each type, with one scaler and with blocks.
FEEDBACK_CASES = [
    # name, n, dtype, block_size (0: one scaler), seed, step, rank, tensor_id
    ("f32_n77", 77, "float32", 0, 3, 9, 1, 21),
    ("f32_n200_b64", 200, "float32", 64, 4, 10, 2, 22),
    ("f64_n77_b64", 77, "float64", 64, 5, 11, 3, 23),
    ("f16_n77", 77, "float16", 0, 6, 12, 4, 24),
    ("bf16_n200_b64", 200, "bfloat16", 64, 7, 13, 5, 25),
]


def feedback_case(case: dict):
    """(g, r, scalers: a float or fp32 per block, RngKey) of a feedback_v1.json case: r is a smaller ramp."""
    from hvd_terngrad import TernGradConfig, codec

    n, dtype, block = case["n"], case["dtype"], case["block_size"]
    g = block_input(n, dtype)
    r = (golden_input(n + 5, "float64")[5:] * 0.125).to(getattr(torch, dtype))
    x = reference.feedback_input(g, r)
    cfg = TernGradConfig(clip=0.0, error_feedback=True, block_size=block or None)
    st = codec.Moments(*reference.moments(x))
    scalers = cfg.block_scalers(st, reference.block_absmax(x, block)) if block else float(cfg.scaler(st))
    return g, r, scalers, codec.RngKey(case["seed"], case["step"], case["rank"], case["tensor_id"])


def main_feedback():
    cases = []
    for name, n, dtype, block, seed, step, rank, tid in FEEDBACK_CASES:
        case = {"name": name, "n": n, "dtype": dtype, "block_size": block, "seed": seed, "step": step,
                "rank": rank, "tensor_id": tid}
        g, r, scalers, key = feedback_case(case)
        x = reference.feedback_input(g, r)
        if block:
            packed = reference.ternarize_pack_blocks(x, scalers, block, seed, step, rank, tid)
            per = reference.per_element(scalers, block, n)
        else:
            packed = reference.ternarize_pack(x, scalers, seed, step, rank, tid)
            per = torch.tensor(scalers, dtype=torch.float32)
        residual = reference.feedback_residual(x, packed, per)
        case.update(packed_hex=bytes(packed.tolist()).hex(),
                    residual_hex=bytes(residual.view(torch.uint8).tolist()).hex(),
                    stats=list(reference.moments(x)))
        cases.append(case)
    path = Path(__file__).with_name("feedback_v1.json")
    path.write_text(json.dumps({"section": 13, "cases": cases}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--blocks"]:  # version 2 only: v1's files stay as they are
        main_blocks()
    elif sys.argv[1:] == ["--feedback"]:  # section 13 only
        main_feedback()
    else:
        main()
        main_sharded()
        main_blocks()
        main_feedback()
