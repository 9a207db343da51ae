"""Outer optimizers on the local shards (DiLoCo and friends), never on a full model copy.

Each rank keeps the anchor (its shards' values at the start of the round, fp32) and the outer
optimizer's state for them: one more fp32 shard for `fedavg` with lr != 1, two for `nesterov`
(anchor, momentum), three for `adam`. At a sync the engine turns the local shards into
pseudo-gradients in place (anchor - local), averages them across groups, and `step` applies
the outer optimizer (a torch optimizer over the anchors, the averaged pseudo-gradient as
their gradient) and copies the new anchors back into the shards.
"""

import torch

OUTER_STATE_PREFIX = "outer."


class OuterOptimizer:
    """torch SGD (fedavg: no momentum; nesterov: Nesterov momentum) or Adam over anchor shards."""

    def __init__(self, shards: list[torch.Tensor], kind: str, lr: float, momentum: float) -> None:
        self.kind = kind
        self.anchors = [s.detach().clone() for s in shards]
        if kind == "fedavg":
            self.optimizer = torch.optim.SGD(self.anchors, lr=lr)
        elif kind == "nesterov":
            self.optimizer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=True)
        elif kind == "adam":
            self.optimizer = torch.optim.Adam(self.anchors, lr=lr, betas=(momentum, 0.999))
        else:
            raise ValueError(f"unknown outer optimizer {kind!r}")

    @torch.no_grad()
    def to_pseudo_gradients(self, shards: list[torch.Tensor]) -> None:
        """shard <- anchor - shard, in place (what the round moved this group, negated)."""
        for shard, anchor in zip(shards, self.anchors):
            torch.sub(anchor, shard, out=shard)

    @torch.no_grad()
    def step(self, shards: list[torch.Tensor]) -> None:
        """Shards hold the averaged pseudo-gradients: step the anchors, then shards <- anchors."""
        for shard, anchor in zip(shards, self.anchors):
            anchor.grad = shard
        self.optimizer.step()
        for shard, anchor in zip(shards, self.anchors):
            anchor.grad = None
            shard.copy_(anchor)

    def reset_anchors(self, shards: list[torch.Tensor]) -> None:
        """Start the next round from `shards` (after a resume that did not restore the anchors)."""
        with torch.no_grad():
            for anchor, shard in zip(self.anchors, shards):
                anchor.copy_(shard)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Anchors and optimizer state as named tensors (for a per-rank safetensors file)."""
        out = {f"{OUTER_STATE_PREFIX}anchor.{i}": a for i, a in enumerate(self.anchors)}
        for i, anchor in enumerate(self.anchors):
            for key, value in self.optimizer.state.get(anchor, {}).items():
                if torch.is_tensor(value):
                    out[f"{OUTER_STATE_PREFIX}state.{i}.{key}"] = value
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, anchor in enumerate(self.anchors):
            key = f"{OUTER_STATE_PREFIX}anchor.{i}"
            if key not in tensors or tensors[key].shape != anchor.shape:
                raise ValueError(f"the saved outer state has no anchor {i} of shape {tuple(anchor.shape)}")
            anchor.copy_(tensors[key])
            prefix = f"{OUTER_STATE_PREFIX}state.{i}."
            state = {k[len(prefix):]: v.clone() for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                self.optimizer.state[anchor] = state
            else:  # saved before any outer step: none since (a voted-down first sync made some)
                self.optimizer.state.pop(anchor, None)
