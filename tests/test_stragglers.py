"""A slow group does not slow the others between syncs: only the next sync waits for it.

FL_MEGATRON_FAULT=delay:1:2:3 makes group 1 sleep 3 s before step 2 (H = 8, 2 groups of 2).
Group 0's own records (groups/group_00000.jsonl, logged every step) must show steps 2-7 at
its undelayed pace and the wait at the sync after step 8. The same run with the coupled loop
(`lockstep`: a world all-reduce after every step, as before) shows the wait at step 2, so the
test can tell the two apart.
"""

import json

import pytest

from cli_utils import SGD, launch

pytestmark = pytest.mark.timeout(600)

DELAY_S = 3.0


def _durations(run_dir, group: int) -> dict:
    """Seconds of each step after the first, from the group's own records."""
    lines = (run_dir / "groups" / f"group_{group:05d}.jsonl").read_text().splitlines()
    elapsed = {r["step"]: r["elapsed_s"] for r in map(json.loads, lines)}
    return {s: elapsed[s] - elapsed[s - 1] for s in sorted(elapsed) if s - 1 in elapsed}


@pytest.mark.parametrize("coupled", [False, True], ids=["decoupled", "lockstep"])
def test_a_delayed_group_holds_up_only_the_next_sync(tmp_path, coupled):
    fault = f"delay:1:2:{DELAY_S:g}" + (",lockstep" if coupled else "")
    proc = launch(4, tmp_path / "run", tmp_path / "cache", *SGD, "--train-iters", "9", "--eval-iters", "0",
                  "--fl-group-size", "2", "--fl-sync-interval", "8", env_extra={"FL_MEGATRON_FAULT": fault})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mine, slow = _durations(tmp_path / "run", 0), _durations(tmp_path / "run", 1)
    assert slow[2] >= DELAY_S  # the delay happened, in group 1
    if coupled:  # every step met the world: group 0 waited at step 2 already
        assert mine[2] >= DELAY_S * 0.8, mine
        return
    between = [mine[s] for s in range(2, 8)]
    assert max(between) < 1.0 and sum(between) < DELAY_S / 2, mine  # steps 2-7 at group 0's own pace
    assert mine[8] >= DELAY_S * 0.8, mine  # the sync after step 8 waited for group 1
    # the summary says who waited: group 0, at the vote, for about the delay; group 1 hardly
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    waits = summary["vote_wait_seconds_per_group"]
    assert waits[0] >= DELAY_S * 0.8 and waits[1] < DELAY_S / 3, waits
    assert "time in votes, mostly waiting for the slower groups: group 0 " in proc.stdout


def test_delay_and_jitter_faults(monkeypatch):
    """delay:G:S:T hits group G before step S only; slow:G:T before every step; jitter:M:SEED is
    the same on every rank of a group (a function of seed, group and step), differs between
    groups, and averages M."""
    from fl_megatron.faults import delay_seconds, lockstep

    monkeypatch.setenv("FL_MEGATRON_FAULT", "delay:1:2:3,jitter:0.05:7")
    jitter = [delay_seconds(0, s) for s in range(1, 2001)]
    assert delay_seconds(1, 2) - delay_seconds(1, 3) != 0 and delay_seconds(1, 2) >= 3.0
    assert jitter == [delay_seconds(0, s) for s in range(1, 2001)]  # reproducible
    assert jitter[:50] != [delay_seconds(1, s) for s in range(1, 51)]
    assert sum(jitter) / len(jitter) == pytest.approx(0.05, rel=0.1) and not lockstep()
    monkeypatch.setenv("FL_MEGATRON_FAULT", "delay:1:2:3,lockstep")
    assert delay_seconds(1, 2) == 3.0 and delay_seconds(0, 2) == 0.0 and delay_seconds(1, 3) == 0.0 and lockstep()
    # slow:G:T hits group G before every step; several add up, and they add to a delay
    monkeypatch.setenv("FL_MEGATRON_FAULT", "slow:1:0.25,slow:2:0.5,slow:2:0.25,delay:1:4:1")
    assert [delay_seconds(g, 3) for g in range(3)] == [0.0, 0.25, 0.75]
    assert delay_seconds(1, 4) == 1.25 and delay_seconds(1, 400) == 0.25
