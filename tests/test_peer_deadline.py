"""The bound on an elastic sync's cross-group collectives (the NCCL path, where a lost or hung peer
never raises), in one process: a call that outlives --fl-peer-timeout-seconds has the communicator
aborted under it by torchft's timer thread, counts as a lost peer whatever it then returns or
raises, and the sync's later cross-group calls are skipped; calls within the bound are untouched."""

import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torchft")

from torchft.futures import context_timeout  # noqa: E402

from fl_megatron.elastic.peer_deadline import PeerDeadline  # noqa: E402
from fl_megatron.federation.failed_collective import PeerLatch  # noqa: E402


class _Communicator:
    """A collective that blocks until it completes (`done`) or is aborted, as NCCL's does."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.aborts = 0
        self.calls = 0

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()

    def hung_collective(self, raise_after_abort: bool) -> str:
        self.calls += 1
        if not self.aborted.wait(timeout=30):
            raise AssertionError("the deadline never aborted the communicator")
        if raise_after_abort:
            raise RuntimeError("NCCL error: ncclInvalidUsage: communicator was revoked")  # not a lost-peer text
        return "garbage"

    def quick_collective(self) -> str:
        self.calls += 1
        return "averaged"


def _latch(comm: _Communicator, seconds: float) -> PeerLatch:
    return PeerLatch(PeerDeadline(timedelta(seconds=seconds), comm.abort, False, context_timeout))


@pytest.mark.parametrize("raise_after_abort", [False, True], ids=["returns", "raises"])
def test_a_hung_collective_is_aborted_at_the_bound_and_the_rest_skipped(raise_after_abort):
    comm = _Communicator()
    latch = _latch(comm, 0.5)
    assert latch(comm.quick_collective) == "averaged" and latch.error is None
    began = time.perf_counter()
    assert latch(comm.hung_collective, raise_after_abort) is None
    waited = time.perf_counter() - began
    assert 0.4 < waited < 10, waited
    assert comm.aborts == 1 and isinstance(latch.error, TimeoutError)
    assert "--fl-peer-timeout-seconds 0.5" in str(latch.error)
    assert latch(comm.quick_collective) is None and comm.calls == 2  # skipped: never called
    assert latch.settle() is latch.error


def test_calls_within_the_bound_are_never_aborted():
    comm = _Communicator()
    latch = _latch(comm, 0.3)
    for _ in range(5):  # together longer than the bound: it bounds each call, not the sync
        time.sleep(0.1)
        assert latch(comm.quick_collective) == "averaged"
    time.sleep(0.5)  # a timer of a finished call must not fire later
    assert comm.aborts == 0 and latch.settle() is None


def test_an_error_of_this_rank_is_raised_not_taken_for_a_lost_peer():
    comm = _Communicator()
    latch = _latch(comm, 5)

    def misuse():
        raise RuntimeError("NCCL error: ncclInvalidUsage: invalid argument")

    with pytest.raises(RuntimeError, match="ncclInvalidUsage"):
        latch(misuse)
    assert comm.aborts == 0 and latch.error is None
