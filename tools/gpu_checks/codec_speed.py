"""The sync codecs on the GPU (tools/gpu_check.py): int8 and int4 encode and decode of 64 Mi fp32
elements, timed with CUDA events after a warm-up (GB/s of fp32 in), the codes compared with the
CPU's for the same values and the round trip's error with half a quantisation step of each block.
The sparse sync (int2 values, top 64 of every 4,096): its selection and encoding, and one payload
added up, in GB/s of fp32 in; what it sends compared with the CPU's; and the link speed at which its
payload's time on the wire equals the codec's (above it, the codec is the sync's bottleneck).
Prints one JSON line: {codec: {encode_gbps, decode_gbps, codes_equal_cpu, max_error_in_steps or
breakeven_gbit_s, problem}}."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fl_megatron.costs import wire_bytes_per_element  # noqa: E402
from fl_megatron.federation.compression import dequantize, quantize  # noqa: E402
from fl_megatron.federation.sparse import SparseCodec  # noqa: E402

ELEMENTS = 64 << 20
REPEATS = 10
COMPARED = 1 << 20  # elements also encoded on the CPU


def timed(fn, repeats: int, cuda: bool = True) -> float:
    """Seconds per call of `fn` (on the current stream: CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    if not cuda:  # the CPU run of the tests
        began = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - began) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def check(x: torch.Tensor, bits: int) -> dict:
    codes, scales = quantize(x, bits)
    encode = timed(lambda: quantize(x, bits), REPEATS, x.is_cuda)
    decode = timed(lambda: dequantize(codes, scales, bits), REPEATS, x.is_cuda)
    cpu_codes, cpu_scales = quantize(x[:COMPARED].cpu(), bits)
    piece = COMPARED // (2 if bits == 4 else 1)
    equal = bool(torch.equal(codes[:piece].cpu(), cpu_codes) and torch.equal(scales[:len(cpu_scales)].cpu(),
                                                                             cpu_scales))
    error = (dequantize(codes, scales, bits) - x).abs().view(scales.numel(), -1)
    steps = float((error / scales.clamp_min(1e-30).unsqueeze(1)).max())
    problems = ([] if equal else ["codes differ from the CPU's"]) + \
               ([] if steps <= 0.5 + 1e-3 else [f"an error of {steps:.3f} steps (at most 0.5)"])
    gb = x.numel() * 4 / 1e9
    return {"encode_gbps": round(gb / encode, 1), "decode_gbps": round(gb / decode, 1), "codes_equal_cpu": equal,
            "max_error_in_steps": round(steps, 4), "problem": "; ".join(problems)}


def sparse_check(x: torch.Tensor, dtype: str = "int2", density: float = 0.0156) -> dict:
    codec = SparseCodec(density, dtype)
    payload = codec.encode(x)[0]
    total = torch.zeros_like(x)
    encode = timed(lambda: codec.encode(x), REPEATS, x.is_cuda)
    decode = timed(lambda: codec.add_decoded_(payload, total), REPEATS, x.is_cuda)
    ours, cpus = torch.zeros(COMPARED), torch.zeros(COMPARED)
    codec.add_decoded_(codec.encode(x[:COMPARED])[0].cpu(), ours)
    codec.add_decoded_(codec.encode(x[:COMPARED].cpu())[0], cpus)
    equal = bool(torch.equal(ours, cpus))
    per_element = (encode + decode) / x.numel()
    gb = x.numel() * 4 / 1e9
    return {"encode_gbps": round(gb / encode, 1), "decode_gbps": round(gb / decode, 1), "codes_equal_cpu": equal,
            "breakeven_gbit_s": float(f"{wire_bytes_per_element(dtype, density) * 8 / per_element / 1e9:.3g}"),
            "problem": "" if equal else "what it sends differs from the CPU's"}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu (the tests)")
    p.add_argument("--elements", type=int, default=ELEMENTS)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.elements, device=args.device)
    print(json.dumps({**{f"int{bits}": check(x, bits) for bits in (8, 4)}, "int2 top 0.0156": sparse_check(x)}),
          flush=True)


if __name__ == "__main__":
    main()
