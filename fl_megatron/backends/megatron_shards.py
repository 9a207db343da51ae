"""The federation engine's view (`ShardOwner`) of megatron-core DistributedOptimizers: their fp32
main shards, the inner optimizer's state of those shards, and the refresh after a sync.

Serves our megatron backend and the Megatron-LM integration alike. Every tensor returned lives on
the device of the main shards (megatron's: the GPU on a GPU run) in fp32.
"""

import torch

from .megatron_cpu import compat_method
from .megatron_state import main_shard_entries
from .optimizer import (forget_state, has_state, load_transfer_state_tensors, split_transfer_state, state_tensors,
                        step_at_zero_lr, transfer_state_tensors)


class MegatronMainShards:
    """`ShardOwner` over megatron DistributedOptimizers and the DDP chunks they update.

    `names` maps id(model parameter) to its name (per-tensor consensus metrics). `regather`:
    whether `refresh_after_sync` all-gathers the new parameters at once; with megatron's
    --overlap-param-gather the next forward's pre-hooks gather them instead (set it False)."""

    def __init__(self, dist_opts: list, model_chunks: list, names: dict[int, str]) -> None:
        self.dist_opts, self.model_chunks, self.names = list(dist_opts), list(model_chunks), names
        self.regather = True

    def entries(self):
        """(model parameter, its fp32 main shard, start, stop) in megatron's order, the same on
        every rank of a peer group; [start, stop) is the shard's range in the flat parameter."""
        for _, param, main, start, stop in main_shard_entries(self.dist_opts):
            yield param, main, start, stop

    def atom_cut(self) -> tuple[str, list[tuple]]:
        """How `atom_shards` cut every parameter across a group, for groups of unequal size: by
        megatron's own buffer map ("ranges": `atom_ranges` gives this rank's part; the plan gathers
        every rank's), each parameter's shape, in the order of `names`."""
        by_id = {id(p): p for chunk in self.model_chunks for p in chunk.parameters()}
        return "ranges", [tuple(by_id[key].shape) for key in self.names]

    def atom_ranges(self) -> list:
        """This rank's [start, stop) of each flattened parameter (None where it holds none), in
        `atom_cut`'s order."""
        spans = {id(param): (start, stop) for param, _, start, stop in self.entries()}
        return [spans.get(key) for key in self.names]

    def atom_shards(self) -> list[torch.Tensor]:
        """Every parameter's fp32 main shard, flat (empty where this rank holds none), in
        `atom_cut`'s order."""
        return [t for _, t in self.named_shards()]

    def local_shards(self) -> list[torch.Tensor]:
        """The fp32 main shards the inner optimizer updates, in megatron's (deterministic) order."""
        return [main for _, main, _, _ in self.entries()]

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """Every named parameter with this rank's fp32 main shard of it, flat (empty when this
        rank holds none), in the order of `names`."""
        mains = {id(param): main for param, main, _, _ in self.entries()}
        device = next(iter(mains.values())).device if mains else torch.device("cpu")
        empty = torch.zeros(0, device=device)
        return [(name, mains.get(key, empty).reshape(-1)) for key, name in self.names.items()]

    @staticmethod
    def _mains(opt) -> list[torch.Tensor]:
        return [main for _, _, main, _, _ in main_shard_entries([opt])]

    def inner_state_shards(self) -> list[torch.Tensor]:
        """Adam moments (or SGD momentum) of every fp32 main shard, in the main shards' order;
        empty before the first step."""
        return [t for opt in self.dist_opts for t in state_tensors(opt.optimizer, self._mains(opt))]

    def atom_optimizer_state(self, make: bool = False) -> tuple[list, list]:
        """The inner optimizers' state for groups of unequal size (as FSDP2's): the moments as
        streams of every parameter's main shard, flat, in `atom_cut`'s order (empty where this
        rank holds none), and the rest (step counts) whole; both empty before the first step.
        `make`: an optimizer without state makes it first, by a step at learning rate 0."""
        moments, rest, per_main = None, [], {}
        for opt in self.dist_opts:
            mains = self._mains(opt)
            if make and mains and not has_state(opt.optimizer, mains):
                step_at_zero_lr(opt.optimizer, mains)
            streams, small = split_transfer_state(opt.optimizer, mains)
            if mains and streams:
                if moments is not None and len(streams) != moments:
                    raise ValueError(f"megatron's optimizers keep {moments} and {len(streams)} moments per shard")
                moments = len(streams)
                per_main.update({id(main): [stream[i] for stream in streams] for i, main in enumerate(mains)})
            rest += small
        if not per_main:
            return [], rest
        mains = {id(param): main for param, main, _, _ in self.entries()}
        empty = torch.zeros(0, device=next(iter(mains.values())).device)
        return [[per_main[id(mains[key])][k] if key in mains else empty for key in self.names]
                for k in range(moments)], rest

    def optimizer_transfer_state(self) -> list[torch.Tensor]:
        """The inner optimizers' whole state of this rank's main shards, step counts included."""
        return [t for opt in self.dist_opts for t in transfer_state_tensors(opt.optimizer, self._mains(opt))]

    @torch.no_grad()
    def load_optimizer_transfer_state(self, tensors: list[torch.Tensor]) -> None:
        """Take a peer rank's `optimizer_transfer_state`; a fresh optimizer's state is made first
        by a step at learning rate 0 (the shards stay as they are, bit for bit)."""
        rest = list(tensors)
        for opt in self.dist_opts:
            mains = self._mains(opt)
            if rest and mains and not has_state(opt.optimizer, mains):
                step_at_zero_lr(opt.optimizer, mains)
            count = len(transfer_state_tensors(opt.optimizer, mains))
            load_transfer_state_tensors(opt.optimizer, mains, [t.to(mains[0].device) for t in rest[:count]])
            rest = rest[count:]
        if rest:
            raise ValueError(f"the optimizer state received has {len(rest)} tensors more than this rank's "
                             "distributed optimizers hold (a peer with another model or shard layout)")

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state, step counts included (the group steps of
        Transformer Engine's FusedAdam too): the moments restart at the next step."""
        for opt in self.dist_opts:
            forget_state(opt.optimizer)

    @compat_method
    def refresh_after_sync(self) -> None:
        """Copy the main shards into the model parameters' buffers, then (with `regather`)
        all-gather those inside the shard group."""
        for opt in self.dist_opts:
            opt._copy_main_params_to_model_params()
        if self.regather:
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)
