"""A script of tools/ loaded as a module, for tests of its functions."""

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool_module(name: str):
    """tools/NAME.py, executed as a module named NAME."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
