"""The files a run leaves in --run-dir: config.json, metrics.jsonl, summary.json (rank 0 writes)."""

import json
import os
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


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
        self._metrics = None
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)

    def open_metrics(self, resumed_at: int = 0) -> None:
        """Start metrics.jsonl. A new run keeps the previous file aside as metrics.previous.jsonl;
        a run resumed at step N keeps the records up to step N and continues after them."""
        if not self.enabled:
            return
        metrics = self.dir / "metrics.jsonl"
        if metrics.exists() and resumed_at:
            kept = [line for line in metrics.read_text().splitlines() if _step_of(line) <= resumed_at]
            atomic_write_text(metrics, "".join(line + "\n" for line in kept))
        elif metrics.exists():
            os.replace(metrics, self.dir / "metrics.previous.jsonl")
        self._metrics = open(metrics, "a", buffering=1)

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
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
