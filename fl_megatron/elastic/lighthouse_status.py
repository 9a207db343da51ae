"""Who the lighthouse hears from, read from its status page (torchft's dashboard, `/status`):
while a group waits, which groups heartbeat and with which settings; when a quorum times out,
which groups are missing."""

import re
import urllib.request
from dataclasses import dataclass

# one entry per replica id the lighthouse has seen; class "old": silent past its heartbeat timeout
_HEARTBEAT = re.compile(r'class="heartbeat\s*(old)?\s*">\s*(\S+): seen')
_GROUP_SLOT = re.compile(r"(?:^|_)group_(\d+)$")


def status_url(lighthouse: str) -> str:
    return (lighthouse if "://" in lighthouse else f"http://{lighthouse}").rstrip("/") + "/status"


_QUORUM_ID = re.compile(r"Current quorum_id:\s*(-?\d+)")


def _status_page(lighthouse: str, timeout_s: float) -> str:
    url = status_url(lighthouse)
    with urllib.request.urlopen(url, timeout=timeout_s) as page:
        text = page.read().decode(errors="replace")
    if "Heartbeats" not in text:
        raise ValueError(f"{url} is not a torchft lighthouse's status page")
    return text


def heartbeating_replicas(lighthouse: str, timeout_s: float = 5.0) -> list:
    """The replica ids (torchft's, with their ':<uuid>') heartbeating now. Raises OSError when the
    lighthouse cannot be reached, ValueError when the page is not its status page."""
    return [replica for old, replica in _HEARTBEAT.findall(_status_page(lighthouse, timeout_s)) if not old]


@dataclass(frozen=True)
class LighthouseStatus:
    """The lighthouse now: its last quorum's id (0: it has formed none) and the group slots heartbeating."""

    quorum_id: int
    groups: frozenset


def lighthouse_status(lighthouse: str, timeout_s: float = 5.0) -> LighthouseStatus:
    """(see heartbeating_replicas for the errors)"""
    text = _status_page(lighthouse, timeout_s)
    found = _QUORUM_ID.search(text)
    if found is None:
        raise ValueError(f"{status_url(lighthouse)} names no current quorum_id")
    slots = (group_slot(replica) for old, replica in _HEARTBEAT.findall(text) if not old)
    return LighthouseStatus(int(found.group(1)), frozenset(slot for slot in slots if slot is not None))


def group_slot(replica: str):
    """The federation group slot of an elastic group's replica id (None for another kind)."""
    match = _GROUP_SLOT.search(replica.split(":", 1)[0])
    return int(match.group(1)) if match else None


def heartbeating_groups(lighthouse: str, timeout_s: float = 5.0) -> set:
    """The slots of the groups heartbeating now (see heartbeating_replicas for the errors)."""
    slots = (group_slot(replica) for replica in heartbeating_replicas(lighthouse, timeout_s))
    return {slot for slot in slots if slot is not None}


def missing_groups_text(lighthouse: str, num_groups: int) -> tuple:
    """(missing slots or None, a sentence naming them) for a quorum that timed out."""
    try:
        live = heartbeating_groups(lighthouse)
    except (OSError, ValueError) as e:
        return None, f"the lighthouse's status page could not be read ({e})"
    missing = tuple(g for g in range(num_groups) if g not in live)
    if not missing:
        return missing, ("every group slot is heartbeating: the missing ones are alive but did not reach this sync "
                         "in time (too slow, or still healing)")
    return missing, f"missing group(s) {', '.join(map(str, missing))} (not heard from by the lighthouse)"
