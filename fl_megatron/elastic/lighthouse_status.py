"""Who the lighthouse hears from, read from its status page (torchft's dashboard, `/status`):
while a group waits, which groups heartbeat and with which settings; when a quorum times out,
which groups are missing."""

import re
import urllib.request

# one entry per replica id the lighthouse has seen; class "old": silent past its heartbeat timeout
_HEARTBEAT = re.compile(r'class="heartbeat\s*(old)?\s*">\s*(\S+): seen')
_GROUP_SLOT = re.compile(r"(?:^|_)group_(\d+)$")


def status_url(lighthouse: str) -> str:
    return (lighthouse if "://" in lighthouse else f"http://{lighthouse}").rstrip("/") + "/status"


def heartbeating_replicas(lighthouse: str, timeout_s: float = 5.0) -> list:
    """The replica ids (torchft's, with their ':<uuid>') heartbeating now. Raises OSError when the
    lighthouse cannot be reached, ValueError when the page is not its status page."""
    url = status_url(lighthouse)
    with urllib.request.urlopen(url, timeout=timeout_s) as page:
        text = page.read().decode(errors="replace")
    if "Heartbeats" not in text:
        raise ValueError(f"{url} is not a torchft lighthouse's status page")
    return [replica for old, replica in _HEARTBEAT.findall(text) if not old]


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
