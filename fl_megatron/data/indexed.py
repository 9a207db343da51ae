"""Megatron-LM's indexed dataset format: ``PREFIX.bin`` + ``PREFIX.idx``.

Files written here are read by megatron-core's ``IndexedDataset`` and the reverse
(format of megatron-core 0.16.1; no megatron import). All numbers little-endian.

``PREFIX.bin``: the tokens of every sequence, back to back, in the dataset dtype.
``PREFIX.idx``: a 34-byte header, then four arrays, in order:

    magic b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B (see DTYPE_CODES)
    | N = sequence count <Q | D = document count <Q
    lengths int32[N] | pointers int64[N] (byte offset of each sequence in .bin)
    | document_indices int64[D] (0, then the sequence index ending each document;
      last == N) | [multimodal only: modes int8[N]]

Multimodal files are not flagged in the header (megatron's reader is told by its
caller); they are recognised here by exactly N trailing bytes and rejected.
"""

from __future__ import annotations

import os
import struct
import uuid
from array import array
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D: 34 bytes

DTYPE_CODES: dict[int, np.dtype] = {
    code: np.dtype(name) for code, name in {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32",
        5: "int64", 6: "float64", 7: "float32", 8: "uint16"}.items()}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_VALIDATE_CHUNK = 1 << 22  # sequences checked per step when validating pointers


class IndexedDatasetError(ValueError):
    """A malformed or unsupported indexed dataset file."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's token dtype rule: uint16 if ``vocab_size < 65500``, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def _paths(prefix) -> tuple[str, str]:
    prefix = os.fspath(prefix)
    return prefix + ".bin", prefix + ".idx"


def dataset_exists(prefix) -> bool:
    """Whether both ``PREFIX.bin`` and ``PREFIX.idx`` are present."""
    return all(os.path.isfile(p) for p in _paths(prefix))


class IndexedDatasetWriter:
    """Streams documents (one sequence each) into ``PREFIX.bin`` / ``PREFIX.idx``.

    Tokens go to ``PREFIX.bin.tmp.<pid>.<random>`` as they come (only the lengths are kept);
    ``finalize`` writes ``PREFIX.idx.tmp...`` and renames .bin then .idx into place,
    so a present .idx marks a complete dataset. Used as a context manager it
    finalizes on success and removes its temporary files on an exception.
    Zero-length documents are allowed (the format and megatron-core permit them).
    """

    def __init__(self, prefix: str | Path, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF or self.dtype.kind not in "iu":
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of "
                             f"{sorted(str(d) for d in _CODE_OF if d.kind in 'iu')}")
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = _paths(self.prefix)
        # unique per writer: concurrent writers of the same prefix (several ranks preparing the
        # same data) never share a temporary file; the last rename wins with identical content
        tag = f".tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._bin_tmp, self._idx_tmp = self.bin_path + tag, self.idx_path + tag
        self._info = np.iinfo(self.dtype)
        self._lengths = array("q")
        self._tokens = 0
        self._done = False
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")

    def add_document(self, tokens) -> None:
        """Append one document (a 1-D sequence of ints) as one sequence."""
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already finalized or aborted")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            arr = arr.astype(self.dtype)
        elif arr.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
        else:
            lo, hi = arr.min(), arr.max()
            if lo < self._info.min or hi > self._info.max:
                bad = lo if lo < self._info.min else hi
                raise ValueError(f"token {int(bad)} out of range for {self.dtype} "
                                 f"[{self._info.min}, {self._info.max}] ({self.prefix})")
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"document of {arr.size} tokens exceeds the int32 length field")
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype.newbyteorder("<")).data)
        self._lengths.append(arr.size)
        self._tokens += arr.size

    def add_documents(self, docs) -> None:
        """``add_document`` for each of ``docs``."""
        for doc in docs:
            self.add_document(doc)

    def finalize(self) -> tuple[int, int]:
        """Write the index, move both files into place; returns (documents, tokens)."""
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already finalized or aborted")
        try:
            self._bin.close()
            n = len(self._lengths)
            lengths = np.frombuffer(self._lengths, dtype=np.int64) if n else np.zeros(0, np.int64)
            pointers = np.zeros(n, dtype="<i8")
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            with open(self._idx_tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], n, n + 1))
                f.write(lengths.astype("<i4").data)
                f.write(pointers.data)
                f.write(np.arange(n + 1, dtype="<i8").data)
            # Drop an old .idx first so an old index never pairs with the new .bin.
            if os.path.exists(self.idx_path):
                os.remove(self.idx_path)
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(self._idx_tmp, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return n, self._tokens

    def abort(self) -> None:
        """Close and remove the temporary files; the final files are left untouched."""
        self._done = True
        try:
            self._bin.close()
        except OSError:  # flushing the buffer failed (a full disk): the file is removed anyway
            pass
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


class IndexedDataset:
    """Memory-mapped reader; the whole file pair is validated on construction.

    ``ds[i]`` / ``ds.get(i, offset, length)`` return views of sequence ``i``'s
    tokens without reading anything else of the .bin.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = os.fspath(prefix)
        bin_path, idx_path = _paths(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")

        def fail(msg):
            raise IndexedDatasetError(f"{idx_path}: {msg}")

        idx_size = os.path.getsize(idx_path)
        if idx_size < _HEADER.size:
            fail(f"{idx_size} bytes, shorter than the {_HEADER.size}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            fail(f"bad magic header {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            fail(f"unsupported version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            fail(f"unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 12 * n + 8 * d
        if idx_size < expected:
            fail(f"index truncated: header says {n} sequences and {d} document indices, "
                 f"needing {expected} bytes, but the file has {idx_size}")
        if idx_size == expected + n and n > 0:
            fail(f"has a sequence_modes array ({n} trailing bytes): multimodal datasets "
                 f"are not supported")
        if idx_size != expected:
            fail(f"{idx_size - expected} unexpected trailing bytes "
                 f"(expected {expected} bytes, got {idx_size})")
        if n == 0:
            fail("empty dataset: 0 sequences")

        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx, "<i4", n, off)
        self.sequence_pointers = np.frombuffer(self._idx, "<i8", n, off + 4 * n)
        self.document_indices = np.frombuffer(self._idx, "<i8", d, off + 12 * n)

        docs = self.document_indices
        if d < 1 or docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0):
            fail(f"document_indices must rise from 0 to {n} (the sequence count), got "
                 f"{d} entries starting {docs[:3].tolist()} ending {docs[-3:].tolist()}")
        self.num_tokens = self._validate_pointers(fail)
        if self.num_tokens == 0:
            fail(f"empty dataset: {n} sequences but 0 tokens")

        expected_bin = self.num_tokens * self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != expected_bin:
            raise IndexedDatasetError(
                f"{bin_path}: size does not match {idx_path}: expected {expected_bin} bytes "
                f"({self.num_tokens} {self.dtype} tokens), actual {bin_size} bytes "
                f"({'truncated' if bin_size < expected_bin else 'too long'})")
        self._bin = np.memmap(bin_path, dtype=self.dtype.newbyteorder("<"), mode="r")

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the dataset, back to back (memory-mapped: nothing is read until indexed)."""
        return self._bin

    def _validate_pointers(self, fail) -> int:
        """Check lengths >= 0 and contiguous pointers from 0; return the token count."""
        lengths, pointers, size = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        total = 0  # tokens before the current chunk
        for start in range(0, len(lengths), _VALIDATE_CHUNK):
            ln = lengths[start:start + _VALIDATE_CHUNK].astype(np.int64)
            if ln.min() < 0:
                i = start + int(np.argmax(ln < 0))
                fail(f"negative length {ln[i - start]} for sequence {i}")
            ends = total + np.cumsum(ln)
            want = np.concatenate(([total], ends[:-1])) * size
            got = pointers[start:start + len(ln)]
            if not np.array_equal(got, want):
                i = start + int(np.argmax(got != want))
                fail(f"sequence pointers not consistent with lengths (non-monotonic): "
                     f"pointer {i} is {got[i - start]}, expected {want[i - start]}")
            total = int(ends[-1])
        return total

    def __len__(self) -> int:
        """The number of sequences."""
        return len(self.sequence_lengths)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``index`` (a view of the map)."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sequence {index} out of range for {n} sequences ({self.prefix})")
        index = int(index) % n
        seq_len = int(self.sequence_lengths[index])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset}+{length}) out of range for "
                             f"sequence {index} of length {seq_len}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return np.asarray(self._bin[start:start + length])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, "
                f"documents={len(self.document_indices) - 1}, tokens={self.num_tokens}, "
                f"dtype={self.dtype})")
