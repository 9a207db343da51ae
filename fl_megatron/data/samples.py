"""Sampling contract: fixed-length samples, seeded epoch orders, rank-to-sample mapping.

Which sample a rank reads depends only on its global rank, the optimizer step
and the micro-batch index, never on how ranks are grouped; this is what makes
runs with different groupings bit-comparable.
"""

from __future__ import annotations

import numpy as np


class TokenSamples:
    """Non-overlapping windows of ``seq_length + 1`` tokens over a token stream.

    Sample ``i`` is ``tokens[i*seq_length : i*seq_length + seq_length + 1]``; the
    extra token is the last sample position's label.
    """

    def __init__(self, tokens, seq_length: int):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        self._len = (len(tokens) - 1) // seq_length
        if self._len < 1:
            raise ValueError(
                f"{len(tokens)} tokens are too few for one sample of seq_length {seq_length} "
                f"(need at least {seq_length + 1})")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        start = i * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length + 1], dtype=np.int64)


class SampleOrder:
    """Maps a global sample counter to a sample index, reshuffling every epoch.

    Counter ``k`` is in epoch ``k // num_samples`` and reads position
    ``k % num_samples`` of a permutation seeded by ``(seed, epoch)``.
    """

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (cached for the most recent epoch)."""
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.num_samples)
            self._epoch = epoch
        return self._perm

    def index(self, k: int) -> int:
        """Sample index read by global counter ``k``."""
        if k < 0:
            raise ValueError(f"sample counter must be >= 0, got {k}")
        epoch, pos = divmod(k, self.num_samples)
        return int(self.permutation(epoch)[pos])


def global_sample_ids(rank: int, step: int, micro_index: int, world_size: int,
                      micro_batch_size: int, accum_steps: int) -> range:
    """Global sample counters read by ``rank`` at optimizer ``step``, micro-batch ``micro_index``.

    Counter = ``((step*accum_steps + micro_index)*world_size + rank)*micro_batch_size + j``
    for ``j < micro_batch_size``: one step consumes a contiguous block of
    ``accum_steps * world_size * micro_batch_size`` counters.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if not 0 <= micro_index < accum_steps:
        raise ValueError(f"micro_index {micro_index} out of range for accum_steps {accum_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    first = ((step * accum_steps + micro_index) * world_size + rank) * micro_batch_size
    return range(first, first + micro_batch_size)


class BatchSource:
    """Training micro-batches for any (rank, step, micro_index), in any call order."""

    def __init__(self, samples, order: SampleOrder | None, world_size: int,
                 micro_batch_size: int, accum_steps: int):
        """`samples[i]` gives sample i; with `order` None, samples are indexed by the global
        counter itself (datasets that shuffle and run epochs themselves)."""
        if order is not None and order.num_samples != len(samples):
            raise ValueError(f"order has {order.num_samples} samples, data has {len(samples)}")
        self.samples = samples
        self.order = order
        self.world_size = world_size
        self.micro_batch_size = micro_batch_size
        self.accum_steps = accum_steps

    def sample_indices(self, rank: int, step: int, micro_index: int) -> list[int]:
        """Sample indices of one micro-batch."""
        ids = global_sample_ids(rank, step, micro_index, self.world_size,
                                self.micro_batch_size, self.accum_steps)
        return [self.order.index(k) if self.order is not None else k for k in ids]

    def micro_batch(self, rank: int, step: int, micro_index: int):
        """LongTensor ``[micro_batch_size, seq_length + 1]``."""
        import torch  # here, so that preprocessing workers importing this package start fast

        rows = [self.samples[i] for i in self.sample_indices(rank, step, micro_index)]
        return torch.from_numpy(np.stack(rows))


def eval_sample_indices(num_samples: int, rank_in_group: int, group_size: int,
                        micro_batch_size: int, num_batches: int) -> list[list[int]]:
    """Sample indices of each held-out batch of one rank (see ``eval_batches``)."""
    if not 0 <= rank_in_group < group_size:
        raise ValueError(f"rank_in_group {rank_in_group} out of range for group_size {group_size}")
    out = []
    for b in range(num_batches):
        first = (b * group_size + rank_in_group) * micro_batch_size
        out.append([(first + j) % num_samples for j in range(micro_batch_size)])
    return out


def eval_batches(samples: TokenSamples, rank_in_group: int, group_size: int,
                 micro_batch_size: int, num_batches: int) -> list:
    """Fixed held-out batches of one rank of a group.

    The group as a whole reads the first ``num_batches*group_size*micro_batch_size``
    samples in order (cycling if there are fewer); batch ``b`` of rank ``r``
    holds block ``b*group_size + r``. Every group of the same size thus
    evaluates the same samples; a group of size ``g`` with ``num_batches=n``
    covers the same samples as a group of size 1 with ``num_batches=g*n``.
    """
    import torch

    per_batch = eval_sample_indices(len(samples), rank_in_group, group_size,
                                    micro_batch_size, num_batches)
    return [torch.from_numpy(np.stack([samples[i] for i in idx])) for idx in per_batch]
