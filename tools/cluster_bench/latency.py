"""A one-way delay between sites, injected where a collective is issued (this kernel has no
sch_netem to delay packets): the caller sleeps for the delay times the one-way hops the
collective's algorithm has in sequence, over the ranks of its process group.

Hops (a ring over n ranks): an all-reduce or a barrier 2(n - 1), an all-gather, reduce-scatter,
all-to-all, broadcast or reduce n - 1, a send or receive 1. A process group of one rank crosses no
link and waits nothing. Ours are caught at the dispatcher (`InjectedLatency`, a TorchDispatchMode
of the thread that enters it); torchft's communicator calls its gloo backend directly, so its
calls are wrapped on the Manager (`delayed_calls`), with one round trip for its quorum."""

import contextlib
import time

from torch.utils._python_dispatch import TorchDispatchMode

from fl_megatron.federation.ledger import collective_ranks

_RING_TWICE = ("allreduce_", "allreduce_coalesced_", "barrier")
_RING_ONCE = ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_coalesced_",
              "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_",
              "alltoall_base_", "broadcast_", "reduce_")
_POINT_TO_POINT = ("send", "recv_", "recv_any_source_")


def hops(op: str, ranks: int) -> int:
    """One-way delays a collective `op` over `ranks` ranks waits in sequence (0: not a collective)."""
    if ranks < 2:
        return 0
    if op in _RING_TWICE:
        return 2 * (ranks - 1)
    if op in _RING_ONCE:
        return ranks - 1
    return 1 if op in _POINT_TO_POINT else 0


class InjectedLatency(TorchDispatchMode):
    """Every c10d collective this thread issues while active first sleeps `delay_s` per hop."""

    def __init__(self, delay_s: float, world: int) -> None:
        super().__init__()
        self.delay_s, self.world = delay_s, world
        self.slept_s = 0.0

    @contextlib.contextmanager
    def paused(self):
        """No delay meanwhile (a benchmark's own barrier and timing)."""
        delay, self.delay_s = self.delay_s, 0.0
        try:
            yield
        finally:
            self.delay_s = delay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.delay_s > 0 and getattr(func, "namespace", "") == "c10d":
            ranks = collective_ranks(args)
            wait = hops(func._schema.name.split("::")[-1], len(ranks) if ranks else 1) * self.delay_s
            if wait:
                time.sleep(wait)
                self.slept_s += wait
        return func(*args, **(kwargs or {}))


class _DelayedClient:
    """torchft's manager client, its quorum call first waiting one round trip to the lighthouse."""

    def __init__(self, client, delay_s: float) -> None:
        self._client, self._delay_s = client, delay_s
        self.slept_s = 0.0  # what every delayed call of the Manager waited in all

    def _quorum(self, *args, **kwargs):
        time.sleep(2 * self._delay_s)
        self.slept_s += 2 * self._delay_s
        return self._client._quorum(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@contextlib.contextmanager
def delayed_calls(manager, delay_s: float, world: int):
    """A torchft Manager whose all-reduces (over `world` groups) and quorum wait as `hops` says;
    yields what counts the time slept (`slept_s`). Checks the private names it wraps (torchft 0.2:
    `_pg.allreduce`, `_client._quorum`)."""
    pg, client = getattr(manager, "_pg", None), getattr(manager, "_client", None)
    if pg is None or client is None or not hasattr(pg, "allreduce") or not hasattr(client, "_quorum"):
        raise RuntimeError("this torchft's Manager has no _pg.allreduce or _client._quorum to delay")
    allreduce = pg.allreduce
    delayed = _DelayedClient(client, delay_s)

    def delayed_allreduce(*args, **kwargs):
        wait = hops("allreduce_", world) * delay_s
        time.sleep(wait)
        delayed.slept_s += wait
        return allreduce(*args, **kwargs)

    pg.allreduce, manager._client = delayed_allreduce, delayed
    try:
        yield delayed
    finally:
        del pg.allreduce
        manager._client = client
