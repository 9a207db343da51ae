"""How fast the sync codecs run on this machine's device, against the link they save.

For a bucket of fp32 elements (--fl-bucket-mb's default, 32 MiB) it times what one rank does per
sync: the dense codecs encode, decode, encode the mean and decode it again (compression.py); the
sparse one selects and encodes, updates its residual, and adds up one payload per group
(sparse.py). It prints nanoseconds per element, what that is for one rank's shard of Llama 3.1 8B
in groups of 8 (about 1e9 elements), and the link speed at which the payload's time on the wire
equals the codec's: on a faster link the codec is the sync's bottleneck.

    python tools/bench_codec.py [--device cuda] [--elements N] [--groups F] [--repeats R]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fl_megatron.costs import SPARSE_CHUNK, wire_bytes_per_element  # noqa: E402
from fl_megatron.federation.compression import dequantize, quantize  # noqa: E402
from fl_megatron.federation.sparse import SparseCodec  # noqa: E402

SHARD_8B = 8.03e9 / 8  # Llama 3.1 8B's parameters over a group of 8 ranks
DENSE = ("int8", "int4")
SPARSE = (("int2", 0.0156), ("int4", 0.0156), ("int8", 0.0156), ("bf16", 0.0156), ("int2", 0.05))


def _timed(work, device: torch.device, repeats: int) -> float:
    """The median seconds of `work()` over `repeats` runs, after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_work(x: torch.Tensor, dtype: str):
    bits = 8 if dtype == "int8" else 4

    def work():
        mean = dequantize(*quantize(x, bits), bits=bits)  # the piece, encoded and decoded
        dequantize(*quantize(mean, bits), bits=bits)      # the mean, encoded once and decoded

    return work


def sparse_work(x: torch.Tensor, dtype: str, density: float, groups: int):
    codec = SparseCodec(density, dtype)
    residual = torch.zeros_like(x)

    def work():
        residual.mul_(0.95).add_(x)
        payload, indices, decoded = codec.encode(residual)
        residual.view(-1, SPARSE_CHUNK).scatter_add_(1, indices, -decoded)
        total = torch.zeros_like(x)
        for _ in range(groups):
            codec.add_decoded_(payload, total)

    return work


def measure(device: torch.device, elements: int, groups: int, repeats: int) -> list[dict]:
    x = torch.randn(elements, device=device)
    rows = []
    cases = [(d, 0.0, dense_work(x, d)) for d in DENSE] + \
        [(d, density, sparse_work(x, d, density, groups)) for d, density in SPARSE]
    for dtype, density, work in cases:
        seconds = _timed(work, device, repeats)
        per_element = seconds / elements
        wire = wire_bytes_per_element(dtype, density)
        # the wire bytes per rank per element: a ring all-reduce of the encoding, or F - 1 payloads
        on_wire = (groups - 1) * wire if density else 2 * (groups - 1) / groups * wire
        rows.append({"codec": dtype + (f" top {density:g}" if density else ""), "ns_per_element": per_element * 1e9,
                     "seconds_8b_shard": per_element * SHARD_8B, "wire_bytes_per_element": on_wire,
                     "breakeven_gbit_s": on_wire * 8 / per_element / 1e9})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--elements", type=int, default=(32 << 20) // 4, help="one bucket (32 MiB of fp32)")
    parser.add_argument("--groups", type=int, default=2, help="federation groups (payloads added up)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.elements % SPARSE_CHUNK:
        parser.error(f"--elements must be a multiple of {SPARSE_CHUNK}")
    device = torch.device(args.device)
    rows = measure(device, args.elements, args.groups, args.repeats)
    threads = torch.get_num_threads()
    print(f"codec speed on {device} ({threads} CPU threads), {args.elements:,} elements, {args.groups} groups, "
          f"median of {args.repeats}:")
    print(f"  {'codec':<16} {'ns/element':>11} {'8B shard':>10} {'wire B/elem':>12} {'codec = wire at':>16}")
    for r in rows:
        print(f"  {r['codec']:<16} {r['ns_per_element']:>11.3f} {r['seconds_8b_shard']:>9.2f}s "
              f"{r['wire_bytes_per_element']:>12.4f} {r['breakeven_gbit_s']:>12.2f} Gbit/s")
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "threads": threads, "elements": args.elements,
                                        "groups": args.groups, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
