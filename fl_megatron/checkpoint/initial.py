"""Where a run's weights start: the seeded initialisation, or a Hugging Face directory."""

from pathlib import Path
from typing import Callable, Optional

from ..backends.common import InitialValues, SeededValues
from ..config.resolved import ResolvedRun
from .paths import read_tracker


def will_resume(run: ResolvedRun) -> bool:
    """Whether --load names a directory that holds a checkpoint."""
    load = run.cfg.checkpoint.load
    return load is not None and read_tracker(Path(load)) is not None


def initial_values_for(run: ResolvedRun, say: Optional[Callable[[str], None]] = None) -> InitialValues:
    """Hugging Face weights for --init-from-hf (unless a checkpoint will replace them anyway),
    else the seeded initialisation."""
    source = run.cfg.checkpoint.init_from_hf
    if source and not will_resume(run):
        from ..convert.hf_init import HFValues

        if say:
            say(f"  initial weights from the Hugging Face directory {source}")
        return HFValues(source, run.cfg.model)
    return SeededValues(run.cfg.model, run.cfg.training.seed)
