"""Before a group's first meeting: in a fresh federation, wait for every group slot.

torchft's lighthouse forms a quorum as soon as --fl-min-groups groups ask and every group it hears
heartbeating has asked (or its join timeout passed). A group whose job comes up a second after the
others' is not heard yet: the quorum forms without it, and it heals into the run at the next sync,
its first H steps lost. So at a fresh start, before asking, the group's first rank waits (at most
--fl-start-wait-seconds) until the lighthouse hears every slot; the lighthouse then waits for them
all to ask. A running federation (the lighthouse formed a quorum, and another group heartbeats) is
met at once: a restarted group heals from it at its next sync.
"""

import time
from typing import Callable

from .lighthouse_status import LighthouseStatus, lighthouse_status


def running(status: LighthouseStatus, own: int) -> bool:
    """Whether a federation is running: a quorum was formed and another group heartbeats."""
    return status.quorum_id > 0 and bool(status.groups - {own})


def wait_for_every_slot(lighthouse: str, num_groups: int, own: int, bound_s: float, say: Callable[[str], None],
                        poll_s: float = 0.5, report_every_s: float = 10.0,
                        read: Callable[[str], LighthouseStatus] = lighthouse_status) -> str:
    """Wait until every slot 0..num_groups-1 heartbeats, a running federation is found, or
    `bound_s` passed (an unreadable status page counts as not yet); returns how it ended."""
    began = time.monotonic()
    reported, status = began, None
    everyone = frozenset(range(num_groups))
    while True:
        try:
            status = read(lighthouse)
        except (OSError, ValueError):
            status = None
        waited = time.monotonic() - began
        if status is not None and running(status, own):
            return f"a federation is running (quorum {status.quorum_id}): meeting it now"
        if status is not None and everyone <= status.groups | {own}:
            return f"every group slot heartbeats ({waited:.1f} s): meeting them"
        if waited >= bound_s:
            heard = "nothing (status page unreadable)" if status is None else \
                ", ".join(map(str, sorted(status.groups | {own})))
            return (f"waited --fl-start-wait-seconds {bound_s:g} for every group slot; heard {heard}: meeting "
                    f"without the others (they heal into the run when they come)")
        if time.monotonic() - reported >= report_every_s:
            reported = time.monotonic()
            missing = "?" if status is None else ", ".join(map(str, sorted(everyone - status.groups - {own})))
            say(f"  group {own}: fresh federation, waiting for group slot(s) {missing} to start "
                f"({waited:.0f} of --fl-start-wait-seconds {bound_s:g})")
        time.sleep(poll_s)
