"""The files a run leaves in --run-dir: config.json, metrics.jsonl, summary.json (rank 0 writes),
and in a federated run groups/group_GGGGG.jsonl (each group's first rank writes its group's)."""

import json
import os
from pathlib import Path

from ..checkpoint.paths import write_text_durably


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_durably(path, text)


def group_metrics_name(group: int) -> str:
    """The records of federation group `group`, relative to the run directory, without .jsonl."""
    return f"groups/group_{group:05d}"


def _step_of(line: str) -> float:
    """The step of one metrics line; a torn last line (the run was killed) counts as past any step."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return float("inf")


class RunFiles:
    """Writes one run's outputs. Only the writer rank touches the files."""

    def __init__(self, run_dir: str, enabled: bool) -> None:
        self.dir = Path(run_dir)
        self.enabled = enabled
        self._metrics = self._detail = self._group = None
        self._resumed_at = 0
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)

    def open_metrics(self, resumed_at: int = 0) -> None:
        """Start metrics.jsonl. A new run keeps the previous file aside as metrics.previous.jsonl;
        a run resumed at step N keeps the records up to step N and continues after them. The
        per-tensor consensus detail (consensus.jsonl) follows the same rule when first written."""
        self._resumed_at = resumed_at
        self._metrics = self._open_jsonl("metrics")

    def open_group_metrics(self, group: int) -> None:
        """Start this group's groups/group_GGGGG.jsonl (on the group's first rank, whether or not
        it writes the run's files), by the same rule as metrics.jsonl."""
        self._group = self._open_jsonl(group_metrics_name(group), always=True)

    def log_group(self, record: dict) -> None:
        if self._group is not None:
            self._group.write(json.dumps(record) + "\n")

    def _open_jsonl(self, name: str, always: bool = False):
        if not (self.enabled or always):
            return None
        path = self.dir / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and self._resumed_at:
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= self._resumed_at]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        elif path.exists():
            os.replace(path, path.with_name(f"{path.stem}.previous.jsonl"))
        return open(path, "a", buffering=1)

    def log_detail(self, record: dict) -> None:
        """One sync's per-tensor consensus metrics, in consensus.jsonl (kept out of metrics.jsonl)."""
        if self.enabled and self._detail is None:
            self._detail = self._open_jsonl("consensus")
        if self._detail is not None:
            self._detail.write(json.dumps(record) + "\n")

    def write_config(self, config_json: str) -> None:
        if self.enabled:
            atomic_write_text(self.dir / "config.json", config_json)

    def log(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        for handle in (self._metrics, self._detail, self._group):
            if handle is not None:
                handle.close()
        self._metrics = self._detail = self._group = None
