"""Which graph a sync uses: the configured topology, a periodic full average, or Ada.

Ada (ours; the paper's rule is not public) moves along a ladder of graphs from sparse to dense
(default: none, one-peer exponential, complete), one step at a time, driven by the relative
consensus distance rho = Xi^2 / mean ||x_g||^2 measured at each sync before mixing:

- reference: the drift of one interval, i.e. rho at the first sync after a full average (or
  at the first sync, when the groups start equal); it follows the learning rate down;
- densify one step when rho > high x reference, sparsify one step when rho < low x reference
  (low < high: hysteresis), at most once every `hold` syncs;
- the first `warmup` syncs use the densest graph: disagreement matters most early (Kong et
  al., 2021). The last sync of a run is always a full average (the engine's rule).

Every rank reads the same all-reduced rho, so every rank takes the same decision.
"""

from dataclasses import dataclass
from typing import Optional

from ..config.parallel import FederationConfig


@dataclass
class Choice:
    """The graph of one sync and, for the one-peer exponential graph, its round."""

    graph: str
    round_index: int = 0


class GraphSchedule:
    """Chooses each sync's graph; call `choose(relative)` once per sync, in order, on every rank."""

    def __init__(self, config: FederationConfig) -> None:
        self.topology = config.topology
        self.every = config.global_average_interval
        self.ladder = config.ada_ladder if config.topology == "ada" else []
        self.low, self.high, self.hold, self.warmup = config.ada_low, config.ada_high, config.ada_hold, config.ada_warmup
        self.syncs = 0
        self.level = len(self.ladder) - 1      # Ada starts on the densest graph
        self.since_change = 0
        self.reference: Optional[float] = None  # rho one interval after a full average
        self.previous = "complete"             # the groups start equal, as after a full average
        self.one_peer_rounds = 0

    def choose(self, relative: float, full: bool = False) -> Choice:
        """The graph for this sync, given its measured relative consensus distance; `full` forces
        a full average (the last sync, a sick group, a compact checkpoint)."""
        self.syncs += 1
        if self.previous == "complete":
            self.reference = relative
        graph = self.topology
        if self.topology == "ada":
            graph = self._ada(relative)
        if full or (self.every and self.syncs % self.every == 0):
            graph = "complete"
        self.previous = graph
        round_index = 0
        if graph == "one-peer-exponential":
            round_index, self.one_peer_rounds = self.one_peer_rounds, self.one_peer_rounds + 1
        return Choice(graph, round_index)

    def _ada(self, relative: float) -> str:
        self.since_change += 1
        if self.syncs > self.warmup and self.since_change >= self.hold and self.reference:
            step = 1 if relative > self.high * self.reference else (-1 if relative < self.low * self.reference else 0)
            new = min(max(self.level + step, 0), len(self.ladder) - 1)
            if new != self.level:
                self.level, self.since_change = new, 0
        return self.ladder[self.level]

    def state(self) -> dict:
        """What a checkpoint needs to continue the same schedule."""
        return {"syncs": self.syncs, "level": self.level, "since_change": self.since_change,
                "reference": self.reference, "previous": self.previous, "one_peer_rounds": self.one_peer_rounds}

    def load_state(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
