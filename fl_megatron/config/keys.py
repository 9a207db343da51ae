"""Refusing unknown keys in config files by name, with the closest valid one: a typo must be an
error, never a silently ignored setting."""

import difflib
from typing import Iterable, Optional


def unknown_keys_problem(keys: Iterable[str], valid: Iterable[str], where: str, what: str = "key",
                         list_valid: bool = True) -> Optional[str]:
    """A message naming every key of `keys` not in `valid` with its closest valid spelling (None
    if all are valid); `list_valid` appends the valid ones."""
    valid = sorted(valid)
    unknown = sorted(set(keys) - set(valid))
    if not unknown:
        return None
    named = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    text = f"{where}: unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(named)}"
    return text + (f"; valid {what}s are {', '.join(valid)}" if list_valid else "")
