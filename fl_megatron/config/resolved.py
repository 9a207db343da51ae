"""A configuration resolved once for a world size: the layout and the accumulation steps."""

from dataclasses import dataclass

from ..topology import Layout
from .run import RunConfig, layout_group_size


@dataclass(frozen=True)
class ResolvedRun:
    """What every part of a run reads instead of recomputing it: the validated settings, the
    rank layout and the micro-batches per optimizer step."""

    cfg: RunConfig
    layout: Layout
    accumulation: int

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens over all ranks in one optimizer step."""
        t = self.cfg.training
        return t.micro_batch_size * self.accumulation * t.seq_length * self.layout.world_size


def resolve(cfg: RunConfig, world_size: int, local_world_size: int | None = None) -> ResolvedRun:
    """Validate `cfg` for `world_size` ranks (ValueError naming every problem) and resolve it."""
    layout = cfg.validate(world_size, local_world_size)
    return ResolvedRun(cfg, layout, cfg.accumulation_steps(world_size, layout_group_size(layout)))
