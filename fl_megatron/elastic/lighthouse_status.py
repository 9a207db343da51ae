"""Who the lighthouse hears from, read from its status page (torchft's dashboard, `/status`):
when a quorum times out, it names the groups that are missing."""

import re
import urllib.request

# one entry per replica id the lighthouse has seen; class "old": silent past its heartbeat timeout
_HEARTBEAT = re.compile(r'class="heartbeat\s*(old)?\s*">\s*group_(\d+):')


def heartbeating_groups(lighthouse: str, timeout_s: float = 5.0) -> set:
    """The slots of the groups heartbeating now (elastic mode's replica ids are `group_G:...`).
    Raises OSError when the lighthouse cannot be reached, ValueError when the page is not its
    status page."""
    url = (lighthouse if "://" in lighthouse else f"http://{lighthouse}").rstrip("/") + "/status"
    with urllib.request.urlopen(url, timeout=timeout_s) as page:
        text = page.read().decode(errors="replace")
    if "Heartbeats" not in text:
        raise ValueError(f"{url} is not a torchft lighthouse's status page")
    return {int(group) for old, group in _HEARTBEAT.findall(text) if not old}


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
