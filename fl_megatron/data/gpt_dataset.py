"""GPT training samples over Megatron indexed datasets (Megatron's GPTDataset semantics).

A split of a dataset is a contiguous range of its documents (`--split 969,30,1`). Every epoch
the split's documents are shuffled (seeded by seed, split, position in a blend and epoch), concatenated into
one token stream and cut into samples of seq_length + 1 tokens that run across document
boundaries (each sample's last token is the next sample's first); the samples of the epoch
are then shuffled. Global sample counter k reads sample k % S of epoch k // S, so a new epoch
starts when the data runs out, and resuming at a consumed-samples count c continues with
counters c, c + 1, ... exactly as an uninterrupted run would.

The per-epoch indices (document order, token offsets, sample order) are cached as .npy files
under a directory keyed by everything they depend on; `prepare()` builds them once (one rank)
and later calls, in any process, memory-map them.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..config.data import parse_data_path, parse_split
from .indexed import IndexedDataset
from .token_range import token_id_problem
from .tokenizer import atomic_write_bytes

INDEX_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")


def split_ranges(num_documents: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges of the splits (Megatron: boundaries rounded from cumulative weights)."""
    bounds = [0]
    for w in np.cumsum(weights):
        bounds.append(int(round(float(w) * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(len(weights))]


def _save_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


class DocumentSamples:
    """Samples of one split of one indexed dataset; `self[k]` for any counter k >= 0."""

    def __init__(self, dataset: IndexedDataset, documents: tuple[int, int], seq_length: int, seed: int,
                 split: str, cache_dir: Optional[Path] = None, stream: int = 0) -> None:
        """`stream`: the dataset's position in a blend, so that blended datasets of equal size
        are not shuffled in lockstep."""
        self.dataset, self.seq_length, self.seed, self.split = dataset, seq_length, seed, split
        self.stream = stream
        self.first_doc, self.stop_doc = documents
        lengths = np.asarray(dataset.sequence_lengths[self.first_doc:self.stop_doc], dtype=np.int64)
        self.num_tokens = int(lengths.sum())
        self.samples_per_epoch = (self.num_tokens - 1) // seq_length if self.num_tokens else 0
        if self.samples_per_epoch < 1:
            raise ValueError(f"the {split} split of {dataset.prefix} (documents {self.first_doc}-{self.stop_doc}, "
                             f"{self.num_tokens} tokens) is too small for one sample of {seq_length + 1} tokens")
        self.cache_dir = Path(cache_dir) / self._key() if cache_dir is not None else None
        self._epoch, self._index = -1, None

    def _key(self) -> str:
        """Hash of everything the indices depend on (the .idx file's identity included)."""
        idx = Path(str(self.dataset.prefix) + ".idx")
        stat = idx.stat()
        fields = [INDEX_VERSION, str(idx.resolve()), stat.st_size, stat.st_mtime_ns, self.first_doc,
                  self.stop_doc, self.seq_length, self.seed, self.split, self.stream]
        return f"{idx.stem}-{self.split}-" + hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        """Samples in one epoch (counters beyond it read later epochs)."""
        return self.samples_per_epoch

    def _rng(self, epoch: int, what: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, SPLIT_NAMES.index(self.split), self.stream, epoch, what])

    def _build(self, epoch: int) -> dict:
        docs = self.first_doc + self._rng(epoch, 0).permutation(self.stop_doc - self.first_doc)
        lengths = self.dataset.sequence_lengths[docs].astype(np.int64)
        starts = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        order_dtype = np.int32 if self.samples_per_epoch < 2**31 else np.int64
        order = self._rng(epoch, 1).permutation(self.samples_per_epoch).astype(order_dtype)
        return {"docs": docs.astype(np.int64), "starts": starts, "order": order}

    def prepare(self, epochs: int) -> None:
        """Build (or find) the cached indices of epochs [0, epochs)."""
        if self.cache_dir is None:
            return
        for epoch in range(epochs):
            if not (self.cache_dir / f"epoch{epoch}-order.npy").is_file():
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                index = self._build(epoch)
                for name in ("docs", "starts", "order"):  # order last: its presence marks a complete epoch
                    _save_npy(self.cache_dir / f"epoch{epoch}-{name}.npy", index[name])

    def prepare_for(self, counters: int) -> None:
        """Build the cached indices that counters [0, counters) need."""
        self.prepare(max(1, -(-counters // self.samples_per_epoch)))

    def _epoch_index(self, epoch: int) -> dict:
        if epoch != self._epoch:
            files = {n: self.cache_dir / f"epoch{epoch}-{n}.npy" for n in ("docs", "starts", "order")} \
                if self.cache_dir is not None else {}
            if files and files["order"].is_file():
                self._index = {n: np.load(p, mmap_mode="r") for n, p in files.items()}
            else:
                self._index = self._build(epoch)
            self._epoch = epoch
        return self._index

    def __getitem__(self, k: int) -> np.ndarray:
        """The seq_length + 1 tokens read by global sample counter k (int64)."""
        if k < 0:
            raise IndexError(f"sample counter {k} is negative")
        epoch, position = divmod(int(k), self.samples_per_epoch)
        index = self._epoch_index(epoch)
        start = int(index["order"][position]) * self.seq_length
        stop = start + self.seq_length + 1
        starts = index["starts"]
        doc = int(np.searchsorted(starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            doc_start, doc_stop = int(starts[doc]), int(starts[doc + 1])
            take = min(stop, doc_stop) - start
            if take > 0:
                pieces.append(self.dataset.get(int(index["docs"][doc]), start - doc_start, take))
                start += take
            doc += 1
        return np.concatenate(pieces).astype(np.int64, copy=False)


_BLEND_CHUNK = 1 << 22  # blended counters computed per step (bounded temporary memory)


def _blend_chunk(cumulative: np.ndarray, start: int, stop: int, counts: np.ndarray):
    """(source, source counter) of blended counters [start, stop); `counts` holds how many
    earlier counters went to each source and is advanced."""
    golden = (np.sqrt(5.0) - 1.0) / 2.0
    positions = np.modf((np.arange(start, stop, dtype=np.float64) + 0.5) * golden)[0]
    which = np.searchsorted(cumulative, positions, side="right").astype(np.int16)
    local = np.empty(stop - start, dtype=np.int64)
    for source in range(len(counts)):
        mask = which == source
        taken = int(mask.sum())
        local[mask] = counts[source] + np.arange(taken, dtype=np.int64)
        counts[source] += taken
    return which, local


class BlendedSamples:
    """Samples drawn from several sources in proportion to their weights.

    Blended counter k goes to source `which[k]` (a low-discrepancy sequence: every prefix of
    the sequence matches the weights to within a few samples) and reads that source's counter
    `local[k]` (how many earlier blended samples went to it), so each source is read in order.
    With a cache directory, `prepare_for` writes these arrays to disk once (10 bytes per
    counter, as Megatron's blend index) and every process memory-maps them.
    """

    def __init__(self, sources: Sequence, weights: Sequence[float], cache_dir: Optional[Path] = None) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("a blend needs one weight per source")
        self.sources = list(sources)
        self.cumulative = np.cumsum(np.asarray(weights, dtype=np.float64) / float(np.sum(weights)))
        self.cumulative[-1] = 1.0
        keys = [getattr(s, "cache_dir", None) for s in self.sources]
        self.cache_dir = None
        if cache_dir is not None and all(k is not None for k in keys):
            fields = [INDEX_VERSION, self.cumulative.tolist(), [k.name for k in keys]]
            self.cache_dir = Path(cache_dir) / ("blend-" + hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16])
        self._which = np.zeros(0, dtype=np.int16)
        self._local = np.zeros(0, dtype=np.int64)
        self._load()

    def _files(self) -> tuple[Path, Path]:
        return self.cache_dir / "which.npy", self.cache_dir / "local.npy"

    def _load(self) -> None:
        if self.cache_dir is not None and self._files()[0].is_file():
            which, local = self._files()
            self._which, self._local = np.load(which, mmap_mode="r"), np.load(local, mmap_mode="r")

    def _compute(self, size: int):
        which = np.empty(size, dtype=np.int16)
        local = np.empty(size, dtype=np.int64)
        counts = np.zeros(len(self.sources), dtype=np.int64)
        for start in range(0, size, _BLEND_CHUNK):
            stop = min(size, start + _BLEND_CHUNK)
            which[start:stop], local[start:stop] = _blend_chunk(self.cumulative, start, stop, counts)
        return which, local

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def prepare_for(self, counters: int) -> None:
        """Build (or find) the blend index of counters [0, counters) and every source's cached
        indices that they need."""
        if counters > len(self._which):
            which, local = self._compute(counters)
            if self.cache_dir is not None:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                which_file, local_file = self._files()
                _save_npy(local_file, local)
                _save_npy(which_file, which)  # last: its presence marks a complete index
                self._load()
            else:
                self._which, self._local = which, local
        which = self._which[:counters]
        for i, source in enumerate(self.sources):
            source.prepare_for(int(np.count_nonzero(which == i)))

    def source_of(self, k: int) -> tuple[int, int]:
        """(source, that source's counter) of blended counter k."""
        if k >= len(self._which) and self.cache_dir is not None:
            self._load()  # another process may have prepared it since this object was made
        if k >= len(self._which):  # beyond what was prepared: compute in memory
            self._which, self._local = self._compute(max(2 * k + 1, 1 << 16))
        return int(self._which[k]), int(self._local[k])

    def __getitem__(self, k: int) -> np.ndarray:
        source, local = self.source_of(int(k))
        return self.sources[source][local]


class MockSamples:
    """Random tokens, a pure function of (seed, counter): for benchmarks without data files."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, samples_per_epoch: int = 1 << 20) -> None:
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.samples_per_epoch = samples_per_epoch

    def __len__(self) -> int:
        return self.samples_per_epoch

    def prepare_for(self, counters: int) -> None:
        """Nothing to build."""

    def __getitem__(self, k: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(k)])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)


def build_splits(data_path: Sequence[str], split: str, splits: Sequence[str], seq_length: int, seed: int,
                 cache_dir: Optional[Path], vocab_size: Optional[int] = None) -> dict:
    """The samples of each split in `splits` ("train", "valid", "test") of a (blended)
    --data-path; every dataset is opened (and validated) once for all of them, and with
    `vocab_size` its token ids are checked to fit (see token_range)."""
    blend = parse_data_path(data_path)
    weights = parse_split(split)
    sources: dict = {which: [] for which in splits}
    for stream, (_, prefix) in enumerate(blend):
        dataset = IndexedDataset(prefix)
        problem = token_id_problem(dataset, vocab_size) if vocab_size is not None else None
        if problem:
            raise ValueError(problem)
        ranges = split_ranges(len(dataset), weights)
        for which in splits:
            first, stop = ranges[SPLIT_NAMES.index(which)]
            if stop <= first:
                raise ValueError(f"--split {split} leaves the {which} split of {prefix} empty "
                                 f"({len(dataset)} documents: train {ranges[0][1] - ranges[0][0]}, "
                                 f"valid {ranges[1][1] - ranges[1][0]}, test {ranges[2][1] - ranges[2][0]})")
            sources[which].append(DocumentSamples(dataset, (first, stop), seq_length, seed, which, cache_dir, stream))
    weights_of_blend = [w for w, _ in blend]
    return {which: parts[0] if len(parts) == 1 else BlendedSamples(parts, weights_of_blend, cache_dir)
            for which, parts in sources.items()}


def build_split_samples(data_path: Sequence[str], split: str, which: str, seq_length: int, seed: int,
                        cache_dir: Optional[Path]):
    """The samples of one split `which` of a (blended) --data-path."""
    return build_splits(data_path, split, [which], seq_length, seed, cache_dir)[which]
