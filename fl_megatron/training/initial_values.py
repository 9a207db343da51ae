"""Where a run's weights start: the seeded initialisation, or a Hugging Face directory."""

from typing import Callable, Optional

from ..backends.common import SeededValues
from ..checkpoint import resume_source
from ..config.resolved import ResolvedRun
from ..federation.contract import InitialValues


def will_resume(run: ResolvedRun) -> bool:
    """Whether --load finds a checkpoint to resume."""
    return resume_source(run.cfg.checkpoint) is not None


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
