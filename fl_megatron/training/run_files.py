"""The files a run leaves in --run-dir: config.json, metrics.jsonl, summary.json (rank 0 writes),
and in a federated run groups/group_GGGGG.jsonl (each group's first rank writes its group's)."""

import json
import os
from pathlib import Path
from typing import Optional

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

    def open_group_metrics(self, group: int, resumed_at: Optional[int] = None) -> None:
        """Start this group's groups/group_GGGGG.jsonl (on the group's first rank, whether or not
        it writes the run's files), by the same rule as metrics.jsonl. `resumed_at`: the group's
        own step where it differs from the run's (per-group step counts)."""
        self._group = self._open_jsonl(group_metrics_name(group), always=True, resumed_at=resumed_at)

    def log_group(self, record: dict) -> None:
        if self._group is not None:
            self._group.write(json.dumps(record) + "\n")

    def _open_jsonl(self, name: str, always: bool = False, resumed_at: Optional[int] = None):
        if not (self.enabled or always):
            return None
        path = self.dir / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        resumed_at = self._resumed_at if resumed_at is None else resumed_at
        if path.exists() and resumed_at:
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resumed_at]
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


def read_jsonl(path: Path) -> list[dict]:
    """The objects of one JSON-lines file; a torn last line (a killed run) is skipped, a bad line
    before it is a ValueError naming the file and line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON object ({e})") from None
    return records


def group_records(run_dir) -> dict[int, list[dict]]:
    """{group: its step records} from RUN_DIR/groups/ (empty for a run with a single group)."""
    files = sorted((Path(run_dir) / "groups").glob("group_[0-9]*[0-9].jsonl"))
    return {int(f.stem.split("_")[1]): [r for r in read_jsonl(f) if "loss" in r] for f in files}


def logged_steps(run_dir) -> list[dict]:
    """One record per logged step over the whole federation. A single group's are metrics.jsonl's;
    in a federated run each step that every group logged is group 0's record with `loss` and
    `grad_norm` replaced by their means over the groups (over all ranks where the groups are of
    equal size; groups of unequal size count alike) and `group_losses` added. Read after the run:
    the groups never met to write it."""
    groups = group_records(run_dir)
    if not groups:
        return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]
    by_step = [{r["step"]: r for r in records} for _, records in sorted(groups.items())]
    merged = []
    for step in sorted(set.intersection(*(set(b) for b in by_step))):
        records = [b[step] for b in by_step]
        losses = [r["loss"] for r in records]
        merged.append({**{k: v for k, v in records[0].items() if k != "group"},
                       "loss": sum(losses) / len(losses), "grad_norm": sum(r["grad_norm"] for r in records) / len(records),
                       "group_losses": losses})
    return merged
