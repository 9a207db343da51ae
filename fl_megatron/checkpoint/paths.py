"""A checkpoint directory on disk, in Megatron-LM's layout, and publishing a new one atomically.

    SAVE/latest_checkpointed_iteration.txt   the newest complete checkpoint (written last)
    SAVE/iter_0000100/metadata.json          what the checkpoint holds, and a manifest of its files
    SAVE/iter_0000100/group_000/ ...         each federation group's state (the backend's format)
    SAVE/iter_0000100/rng/rank_00000.safetensors   each rank's random states and byte counters

A checkpoint is written under `.iter_NNNNNNN.staging/` and renamed into place when complete; the
pointer file is replaced after that. A crash at any moment leaves the previous checkpoint usable.
"""

import os
import re
import shutil
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
_ITER = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f".iter_{iteration:07d}.staging"


def group_dir(checkpoint: Path, group: int) -> Path:
    return Path(checkpoint) / f"group_{group:03d}"


def rng_file(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / "rng" / f"rank_{rank:05d}.safetensors"


def outer_file(checkpoint: Path, rank: int) -> Path:
    """This rank's outer-optimizer anchors and state and error-feedback residuals."""
    return Path(checkpoint) / "outer" / f"rank_{rank:05d}.safetensors"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: Path, text: str) -> None:
    """Write through a temporary file, fsync, rename: readers see the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise
    _fsync_dir(path.parent)


def iteration_number(name: str) -> int | None:
    """N of a directory named iter_NNNNNNN, else None."""
    m = _ITER.match(name)
    return int(m.group(1)) if m else None


def published_iterations(root: Path) -> list[int]:
    """Iterations with a published directory, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _ITER.match(p.name))]
    return sorted(found)


def read_tracker(root: Path) -> int | None:
    """The iteration the pointer file names, or None when there is no pointer."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds {text[:40]!r}, not an iteration number")
    return int(text)


def publish(root: Path, iteration: int) -> Path:
    """Rename the complete staging directory into place, then point the tracker at it."""
    root = Path(root)
    staging, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    if final.exists():  # the same iteration saved again (a resumed run): keep it until replaced
        old = root / f".iter_{iteration:07d}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(root)
    write_text_durably(root / TRACKER, f"{iteration}\n")
    return final


def prune(root: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` published checkpoints (never the tracker's). Returns
    the deleted iterations."""
    current = read_tracker(root)
    iterations = published_iterations(root)
    doomed = [i for i in iterations[:-keep_last] if i != current] if keep_last < len(iterations) else []
    for iteration in doomed:
        shutil.rmtree(iteration_dir(root, iteration))
    return doomed


def clear_staging(root: Path) -> None:
    """Remove what interrupted saves left behind (never a published checkpoint)."""
    root = Path(root)
    if root.is_dir():
        for path in root.glob(".iter_*.staging"):
            shutil.rmtree(path, ignore_errors=True)
