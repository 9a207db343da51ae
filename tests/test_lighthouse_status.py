"""The lighthouse's status page names who is heartbeating: a real torchft lighthouse, groups
heartbeating to it as elastic mode's managers do (replica ids `group_G:...`), one falling silent."""

import threading
import time
from datetime import timedelta

import pytest

torchft = pytest.importorskip("torchft")

from fl_megatron.elastic.lighthouse_status import heartbeating_groups, missing_groups_text  # noqa: E402


def _beat(client, *groups):
    for g in groups:
        client.heartbeat(f"group_{g}:replica-{g}")


def test_the_status_page_names_the_heartbeating_groups_and_the_missing_ones():
    from torchft._torchft import LighthouseClient, LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=3, heartbeat_timeout_ms=400)
    try:
        address = lighthouse.address()
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        _beat(client, 0, 1, 3)
        assert heartbeating_groups(address) == {0, 1, 3}
        assert missing_groups_text(address, 4)[0] == (2,)
        # group 1 falls silent past the heartbeat timeout; the others go on beating
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            _beat(client, 0, 3)
            time.sleep(0.1)
        assert heartbeating_groups(address) == {0, 3}
        missing, text = missing_groups_text(address, 4)
        assert missing == (1, 2) and "missing group(s) 1, 2" in text
        _beat(client, 1, 2)  # back: nobody is missing
        assert missing_groups_text(address, 4)[0] == ()
    finally:
        lighthouse.shutdown()


def test_an_unreachable_lighthouse_is_said_not_guessed():
    from fl_megatron.launching.ports import free_port

    missing, text = missing_groups_text(f"127.0.0.1:{free_port()}", 3)  # a port nobody listens on
    assert missing is None and "could not be read" in text


def test_a_fresh_federation_waits_for_every_slot_and_a_running_one_does_not():
    from torchft._torchft import LighthouseClient, LighthouseServer

    from fl_megatron.elastic.lighthouse_status import LighthouseStatus, lighthouse_status
    from fl_megatron.elastic.start_wait import wait_for_every_slot

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, heartbeat_timeout_ms=2000)
    try:
        address = lighthouse.address()
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        _beat(client, 0, 1)
        assert lighthouse_status(address) == LighthouseStatus(0, frozenset({0, 1}))  # no quorum formed yet
        lines = []
        began = time.monotonic()
        ended = wait_for_every_slot(address, 3, 0, 1.0, lines.append, poll_s=0.1, report_every_s=0.3)
        assert 1.0 <= time.monotonic() - began < 3 and "waited --fl-start-wait-seconds 1" in ended
        assert "heard 0, 1" in ended and any("waiting for group slot(s) 2" in line for line in lines)
        # group 2's job comes up half a second later: the wait ends when the lighthouse hears it
        later = threading.Timer(0.5, _beat, (client, 2))
        later.start()
        began = time.monotonic()
        ended = wait_for_every_slot(address, 3, 0, 30.0, lines.append, poll_s=0.1)
        later.join()
        assert 0.4 < time.monotonic() - began < 5 and ended.startswith("every group slot heartbeats")
    finally:
        lighthouse.shutdown()
    # a running federation (a quorum formed, another group heartbeats) is met at once, even with a
    # slot missing for good; a lighthouse that formed a quorum but hears nobody else is a fresh start
    running = LighthouseStatus(7, frozenset({0, 2}))
    assert "running (quorum 7)" in wait_for_every_slot("x", 3, 0, 30.0, print, read=lambda _: running)
    alone = LighthouseStatus(7, frozenset({0}))
    assert "waited" in wait_for_every_slot("x", 3, 0, 0.2, print, poll_s=0.05, read=lambda _: alone)
