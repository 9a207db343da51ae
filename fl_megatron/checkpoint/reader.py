"""Read a saved checkpoint's parameters one tensor at a time (tools: the Hugging Face export):
the checkpoint's metadata and groups here; each backend's format is read by the backend
(`backends.saved_groups`)."""

from pathlib import Path

import torch

from ..backends.saved_groups import saved_group_reader
from ..config.model import ModelConfig
from ..models import build_model
from .metadata import find_checkpoint
from .paths import group_dir


class CheckpointReader:
    """The parameters of a checkpoint: per group, or averaged over the groups (what the next
    sync would give). Never holds more than the tensor being read plus a running sum."""

    def __init__(self, root: str | Path, iteration: int | None = None) -> None:
        self.path, self.meta = find_checkpoint(Path(root), iteration)
        self.iteration = self.meta["iteration"]
        self.model_cfg = ModelConfig(**self.meta["model"])
        self.groups: list[int] = self.meta["groups_saved"]
        self._shapes = {name: tuple(p.shape) for name, p in build_model(self.model_cfg, "meta").named_parameters()}
        self.names = list(self._shapes)
        self._readers: dict[int, object] = {}

    def tensor(self, name: str, group: int) -> torch.Tensor:
        """Parameter `name` (our naming) of saved group `group`, fp32."""
        if group not in self.groups:
            raise ValueError(f"checkpoint {self.path} holds groups {', '.join(map(str, self.groups))}, not {group}")
        if group not in self._readers:
            self._readers[group] = saved_group_reader(self.meta["backend"], group_dir(self.path, group),
                                                      self.model_cfg, self._shapes)
        out = self._readers[group](name)
        if tuple(out.shape) != self._shapes[name]:
            raise ValueError(f"checkpoint {self.path}: {name} has shape {tuple(out.shape)}, the model says "
                             f"{self._shapes[name]}")
        return out

    def averaged(self, name: str) -> torch.Tensor:
        """The mean of parameter `name` over the saved groups (fp32 sum, then divide, as a sync does)."""
        total = self.tensor(name, self.groups[0]).clone()
        for group in self.groups[1:]:
            total += self.tensor(name, group)
        return total.div_(len(self.groups)) if len(self.groups) > 1 else total
