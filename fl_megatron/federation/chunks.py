"""Cutting a list of shards into the pieces that one collective each averages.

Large shards are averaged in place (no copy), in pieces of a few buckets; small shards are packed
into bucket buffers so that a model of many small tensors still moves in few collectives.
With HSDP replica split every piece's length is a multiple of the replica count P, so each
replica can average one equal slice of it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + length) of flat shard number `index`."""

    index: int
    start: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One collective's worth of elements: a single in-place segment or several packed ones."""

    segments: tuple[Segment, ...]
    inplace: bool

    @property
    def length(self) -> int:
        return sum(s.length for s in self.segments)

    def padded_length(self, replicas: int) -> int:
        """Buffer length: rounded up to a multiple of `replicas` (packed chunks only pad)."""
        return -(-self.length // replicas) * replicas


def plan_chunks(numels: list[int], bucket_elements: int, replicas: int = 1,
                inplace_min: int | None = None, inplace_max: int | None = None) -> list[Chunk]:
    """Pieces covering every element of every shard exactly once, in shard order.

    A shard of at least `inplace_min` elements (default: an eighth of a bucket) is averaged in
    place, without a copy, in pieces of at most `inplace_max` elements (default: 8 buckets; a
    limit only so that consecutive pieces pipeline) whose lengths are multiples of `replicas`;
    its last `numel % replicas` elements and all smaller shards are packed into buckets of at
    most `bucket_elements`.
    """
    if bucket_elements < replicas or bucket_elements < 1:
        raise ValueError(f"bucket of {bucket_elements} elements is smaller than replicas={replicas}")
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be at least 1")
    inplace_min = max(replicas, min(bucket_elements,
                                   inplace_min if inplace_min is not None else bucket_elements // 8), 1)
    inplace_max = max(inplace_max if inplace_max is not None else 8 * bucket_elements, replicas)
    piece = inplace_max // replicas * replicas
    chunks: list[Chunk] = []
    packed: list[Segment] = []
    packed_len = 0

    def add_packed(seg: Segment) -> None:
        nonlocal packed, packed_len
        if packed and packed_len + seg.length > bucket_elements:
            chunks.append(Chunk(tuple(packed), inplace=False))
            packed, packed_len = [], 0
        packed.append(seg)
        packed_len += seg.length

    for index, numel in enumerate(numels):
        if numel >= inplace_min:
            body = numel - numel % replicas
            for start in range(0, body, piece):
                chunks.append(Chunk((Segment(index, start, min(piece, body - start)),), inplace=True))
            if numel > body:
                add_packed(Segment(index, body, numel - body))
        elif numel > 0:
            add_packed(Segment(index, 0, numel))
    if packed:
        chunks.append(Chunk(tuple(packed), inplace=False))
    return chunks
