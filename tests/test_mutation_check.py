"""tools/mutation_check.py stays usable: every mutation's code occurs exactly once where it says
(so a refactor that moves the code shows up here, not as a mutation that silently breaks nothing),
and every test it names exists."""

import re
from pathlib import Path
from tool_loader import tool_module

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    return tool_module("mutation_check")


def test_every_mutation_applies_once_and_names_tests_that_exist(tmp_path):
    tool = _tool()
    assert len({m.name for m in tool.MUTATIONS}) == len(tool.MUTATIONS) >= 9
    for m in tool.MUTATIONS:
        target = tmp_path / m.name / m.path
        target.parent.mkdir(parents=True)
        target.write_text((ROOT / m.path).read_text())
        tool.apply(tmp_path / m.name, m)  # raises unless the code occurs exactly once
        assert target.read_text() != (ROOT / m.path).read_text(), m.name
        for node in m.tests:
            path, _, test = node.partition("::")
            source = (ROOT / path).read_text()
            name = re.sub(r"\[.*\]$", "", test)
            assert not name or f"def {name}(" in source, (m.name, node)
            param = re.search(r"\[(.*)\]$", test)
            assert not param or f'id="{param.group(1)}"' in source, (m.name, node)
