"""TensorBoard and Weights & Biases: the scalars of every metrics.jsonl record, from rank 0.

`--tensorboard-dir DIR` writes event files with torch.utils.tensorboard; `--wandb-project P`
logs to wandb (its mode, e.g. offline, comes from WANDB_MODE as usual). Both use the
record's "step" as the global step. wandb is only imported and initialised when asked for.
"""

import importlib.util
from pathlib import Path
from typing import Optional

from ..config.training import TrainingConfig

# metrics.jsonl key -> dashboard tag; other numeric keys become "train/<key>" or "eval/<key>".
TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
    "tokens_per_s": "train/tokens_per_s",
    "intra_group_bytes": "comm/intra_group_bytes", "inter_group_bytes": "comm/inter_group_bytes",
    "intra_node_bytes": "comm/intra_node_bytes", "inter_node_bytes": "comm/inter_node_bytes",
    "synced": "sync/synced", "sync_seconds": "sync/seconds", "param_variance": "sync/param_variance",
    "param_rms": "sync/param_rms", "sync_exchange_seconds": "sync/exchange_seconds",
    "prev_sync_param_variance": "sync/prev_sync_param_variance", "prev_sync_param_rms": "sync/prev_sync_param_rms",
    "sync_inter_node_bytes_per_s": "sync/inter_node_bytes_per_s",
    "sync_intra_node_bytes_per_s": "sync/intra_node_bytes_per_s", "sync_wait_fraction": "sync/wait_fraction",
    "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity",
}

# package -> (flag that needs it, pip extra that installs it)
_NEEDED_BY = {"tensorboard": ("--tensorboard-dir", "tensorboard"), "wandb": ("--wandb-project", "wandb")}


def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_dashboard_packages(training: TrainingConfig) -> None:
    """ValueError naming the pip extra when a dashboard was asked for but its package is missing.

    Cheap (no import), so the entry point runs it before any process group or model exists."""
    wanted = [p for p, on in (("tensorboard", training.tensorboard_dir), ("wandb", training.wandb_project)) if on]
    missing = [p for p in wanted if not _importable(p)]
    if missing:
        raise ValueError("; ".join(
            f"{_NEEDED_BY[p][0]} needs the {p!r} package, which is not installed: "
            f"pip install -e \".[{_NEEDED_BY[p][1]}]\" (or pip install {p})" for p in missing))


def scalars(record: dict) -> dict:
    """The record's numeric fields as {tag: float}, without "step"."""
    prefix = "eval" if "eval_loss" in record else "train"
    out = {}
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
            out[TAGS.get(key, f"{prefix}/{key}")] = float(value)
    return out


class Dashboards:
    """The dashboards asked for, on the writer rank; a no-op elsewhere or when none was asked for."""

    def __init__(self, training: TrainingConfig, run_config: dict, enabled: bool) -> None:
        self._tensorboard = None
        self._wandb = None
        if not enabled:
            return
        if training.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=training.tensorboard_dir, flush_secs=10)
        if training.wandb_project:
            import wandb

            name = training.wandb_exp_name or Path(training.run_dir).resolve().name
            self._wandb = wandb.init(project=training.wandb_project, name=name, dir=training.run_dir,
                                     config=run_config)

    def log(self, record: dict) -> None:
        if self._tensorboard is None and self._wandb is None:
            return
        step, values = int(record["step"]), scalars(record)
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class RunRecords:
    """Fans each record out to metrics.jsonl (RunFiles) and the dashboards; closes both."""

    def __init__(self, files, dashboards: Optional[Dashboards]) -> None:
        self.files, self.dashboards = files, dashboards

    def log(self, record: dict) -> None:
        self.files.log(record)
        if self.dashboards is not None:
            self.dashboards.log(record)

    def close(self) -> None:
        try:
            if self.dashboards is not None:
                self.dashboards.close()
        finally:
            self.files.close()
