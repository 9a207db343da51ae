"""A compressed mean across a process group: bf16, or int8 / int4 with one fp32 scale per block.

Plain all-reduce would add compressed values in low precision. Instead every rank encodes its
region, an all-to-all sends rank j the j-th piece of everyone's encoding, rank j decodes and
sums its piece in fp32, divides, encodes the mean once, and an all-gather returns every piece
to everyone. The wire carries the encoded size twice, as a ring all-reduce of it would, and
every rank decodes the same bytes: the groups end bit-identical.

With error feedback the rank adds the residual of its previous encodings before encoding and
keeps what its encoding lost (only the first encoding: the second is the same on every rank).
int4 packs two values per byte; at 15 levels per block it needs error feedback to keep small,
steady pseudo-gradients from rounding away.
"""

from typing import Optional

import torch
import torch.distributed as dist

from ..costs import QUANT_BITS
from ..costs import QUANT_BLOCK as BLOCK  # elements per scale: the wire format the cost model counts
from ..torch_version import all_gather_flat


def quantize(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, fp32 scale per block) of a 1-D fp32 tensor whose length divides by BLOCK. Each
    block is scaled by its largest magnitude / (2^(bits-1) - 1) and rounded to nearest; 8 bits
    give int8 codes, 4 bits two codes per uint8 (low nibble first, offset by 8)."""
    if bits not in (4, 8):
        raise ValueError(f"quantize supports 4 or 8 bits, not {bits}")
    levels = 2 ** (bits - 1) - 1
    blocks = x.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe.unsqueeze(1)).clamp_(-levels, levels).to(torch.int8).view(-1)
    if bits == 4:
        nibbles = q.add_(8).view(torch.uint8).view(-1, 2)
        q = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return q, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The fp32 values `quantize` encoded."""
    if bits == 4:
        values = torch.stack([codes & 15, codes >> 4], dim=1).view(-1).to(torch.float32).sub_(8)
    else:
        values = codes.to(torch.float32)
    return (values.view(-1, BLOCK) * scales.unsqueeze(1)).view(-1)


class _Codec:
    """Encode/decode fp32 pieces of equal length (a multiple of BLOCK) for the wire."""

    def __init__(self, dtype: str) -> None:
        if dtype != "bf16" and dtype not in QUANT_BITS:
            raise ValueError(f"no compressed encoding for sync_dtype={dtype!r}")
        self.dtype = dtype
        self.bits = QUANT_BITS.get(dtype)

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.bits is None:
            return [x.to(torch.bfloat16)]
        return list(quantize(x, self.bits))

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.bits is None:
            return parts[0].float()
        return dequantize(*parts, bits=self.bits)


def compressed_mean_(region: torch.Tensor, group, dtype: str, *, include: bool = True,
                     contributors: Optional[int] = None, residual: Optional[torch.Tensor] = None,
                     decay: float = 1.0) -> int:
    """Replace `region` (1-D fp32, contiguous) by the mean over `group` of every rank's encoded
    region; ranks with `include=False` send zeros and `contributors` (default: the group size)
    divides; `residual` (error feedback) is multiplied by `decay` before it is added. Returns this
    rank's encoded payload in bytes (what an all-reduce of the encoding
    would carry; the wire moves it twice, like the ring all-reduce the cost model counts)."""
    codec = _Codec(dtype)
    size = dist.get_world_size(group)
    contributors = size if contributors is None else contributors
    n = region.numel()
    piece = -(-n // (size * BLOCK)) * BLOCK
    padded = region.new_zeros(piece * size)
    if include:
        padded[:n] = region
        if residual is not None:
            padded[:n].add_(residual, alpha=decay)
    sent = codec.encode(padded)
    if residual is not None and include:
        residual.copy_(padded[:n] - codec.decode(sent)[:n])
    elif residual is not None:
        residual.zero_()
    received = [torch.empty_like(part) for part in sent]
    for out, inp in zip(received, sent):
        dist.all_to_all_single(out, inp, group=group)
    pieces = [codec.decode([part.view(size, -1)[j] for part in received]) for j in range(size)]
    mean = torch.stack(pieces).sum(dim=0).div_(contributors)
    mine = codec.encode(mean)
    gathered = [part.new_empty((size, *part.shape)) for part in mine]
    for out, inp in zip(gathered, mine):
        all_gather_flat(out.view(-1), inp, group=group)
    whole = torch.cat([codec.decode([part[j] for part in gathered]) for j in range(size)])
    region.copy_(whole[:n])
    return sum(part.numel() * part.element_size() for part in sent)
