"""The lighthouse's status page names who is heartbeating: a real torchft lighthouse, groups
heartbeating to it as elastic mode's managers do (replica ids `group_G:...`), one falling silent."""

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
