"""Every number of a configuration must be finite: nan or inf in a learning rate, a clip norm or
a ratio passes comparisons like `lr > 0` unnoticed (or makes them say something misleading) and
ruins the run later. Python's float() and json.loads accept "nan", "inf", NaN and Infinity."""

import dataclasses
import math
from typing import Any, Iterator


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def nonfinite_in_json(value: Any, path: str) -> Iterator[str]:
    """`path=value` for every non-finite number inside a JSON value (nested objects and lists)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from nonfinite_in_json(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from nonfinite_in_json(item, f"{path}[{index}]")
    elif _nonfinite(value):
        yield f"{path}={value!r}"


def nonfinite_fields(sections: dict) -> list[str]:
    """`section.field=value` for every non-finite float of the given dataclass sections."""
    found = []
    for name, section in sections.items():
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if any(_nonfinite(v) for v in (value if isinstance(value, list) else [value])):
                found.append(f"{name}.{f.name}={value!r}")
    return found
