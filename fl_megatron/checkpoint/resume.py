"""Which checkpoint `--load` resumes from."""

from pathlib import Path
from typing import Optional

from ..config.checkpoint import CheckpointConfig
from .paths import TRACKER, iteration_number, published_iterations, read_tracker


def resume_source(options: CheckpointConfig) -> Optional[tuple[Path, int]]:
    """(checkpoint directory, iteration) that --load resumes from, or None for a fresh start.

    `--load DIR` takes DIR's latest (its tracker) or `--load-iteration N`; `--load DIR/iter_NNNNNNN`
    takes that one. A directory holding checkpoints but no tracker is refused rather than
    silently trained from step 0 over them."""
    if options.load is None:
        return None
    path = Path(options.load)
    named = iteration_number(path.name)
    if named is not None and not path.is_dir():
        have = published_iterations(path.parent)
        raise ValueError(f"--load {path}: no such checkpoint directory ({path.parent} has "
                         f"{'iterations ' + ', '.join(map(str, have)) if have else 'no checkpoints'})")
    if named is not None:
        if options.load_iteration not in (None, named):
            raise ValueError(f"--load {path} names iteration {named} but --load-iteration is "
                             f"{options.load_iteration}: give one of them")
        return path.parent, named
    if options.load_iteration is not None:
        return path, options.load_iteration
    tracker = read_tracker(path)
    if tracker is not None:
        return path, tracker
    have = published_iterations(path)
    if have:
        raise ValueError(f"--load {path} holds checkpoints of iterations {', '.join(map(str, have))} but no "
                         f"{TRACKER} naming the latest: give --load-iteration N (or --load {path}/iter_NNNNNNN)")
    return None
