"""Reading full parameters out of a checkpoint of either backend, one tensor at a time, in one
process without a process group (for conversion tools and tests)."""

import contextlib
import io
from pathlib import Path

import torch

from ..config.model import ModelConfig
from ..backends.pickle_guard import GuardedPlanner, GuardedReader, check_deepspeed_dir
from ..models import build_model
from ..models.init import canonical_name
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
        self._deepspeed: dict[int, dict] = {}
        self._megatron: dict[int, object] = {}

    def tensor(self, name: str, group: int) -> torch.Tensor:
        """Parameter `name` (our naming) of saved group `group`, fp32."""
        if group not in self.groups:
            raise ValueError(f"checkpoint {self.path} holds groups {', '.join(map(str, self.groups))}, not {group}")
        if self.meta["backend"] == "deepspeed":
            out = self._deepspeed_state(group)[name].contiguous().float()
        elif self.meta["backend"] == "megatron":
            out = self._megatron_tensor(group, name)
        else:
            out = self._dcp_tensor(group_dir(self.path, group), name)
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

    def _dcp_tensor(self, directory: Path, name: str) -> torch.Tensor:
        import warnings

        import torch.distributed.checkpoint as dcp

        target = torch.empty(self._shapes[name], dtype=torch.float32)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {name: target}}, storage_reader=GuardedReader(str(directory)),
                     planner=GuardedPlanner(), no_dist=True)
        return target

    def _deepspeed_state(self, group: int) -> dict:
        """DeepSpeed's fp32 reconstruction of a group, lazily (optimizer files memory-mapped)."""
        if group not in self._deepspeed:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            from ..backends.deepspeed_zero3 import CHECKPOINT_TAG

            check_deepspeed_dir(group_dir(self.path, group) / CHECKPOINT_TAG)
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # per-file progress
                state = get_fp32_state_dict_from_zero_checkpoint(str(group_dir(self.path, group)),
                                                                 tag=CHECKPOINT_TAG, lazy_mode=True)
            self._deepspeed[group] = {canonical_name(k): v for k, v in state.items()}
        return self._deepspeed[group]

    def _megatron_tensor(self, group: int, name: str) -> torch.Tensor:
        """Our parameter `name` from a megatron group's shard files (fused tensors split)."""
        from ..backends.megatron_names import megatron_layout, our_sources, our_tensor
        from ..backends.megatron_state import ShardFileReader

        if group not in self._megatron:
            layout = megatron_layout(self.model_cfg)
            shapes = {theirs: (sum(p.rows for p in pieces), *self._shapes[pieces[0].name][1:])
                      for theirs, pieces in layout.items()}
            self._megatron[group] = (ShardFileReader(group_dir(self.path, group), shapes), our_sources(layout))
        reader, sources = self._megatron[group]
        if name not in sources:
            raise ValueError(f"{name} is not a parameter of this model")
        return our_tensor(sources[name], reader)
