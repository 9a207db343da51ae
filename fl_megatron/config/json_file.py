"""Reading a JSON object from a file, with errors that name the file and position."""

import json
from pathlib import Path


def read_json_object(path: str, what: str, top_level: str = "an object") -> dict:
    """The object in `path`; `what` names the file in errors ("config file", "DeepSpeed config")."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: the top level must be {top_level}")
    return data
