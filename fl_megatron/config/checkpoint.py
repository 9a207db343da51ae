"""Saving, resuming, exiting early and starting from Hugging Face weights (Megatron-LM's flag names)."""

from dataclasses import dataclass, field
from typing import Optional

CHECKPOINT_MODES = ("exact", "compact")


@dataclass
class CheckpointConfig:
    """Where checkpoints go and come from, how many are kept, and when a run stops early."""

    save: Optional[str] = field(default=None, metadata={"help": "directory to save checkpoints in (iter_NNNNNNN/ "
                                                               "subdirectories and latest_checkpointed_iteration.txt; "
                                                               "elastic: in DIR/group_GGGGG, one per group)"})
    save_interval: Optional[int] = field(
        default=None, metadata={"help": "save every this many steps (and at the end); default: only at the end "
                                        "and when exiting early"})
    load: Optional[str] = field(
        default=None, metadata={"help": "resume from the latest checkpoint in this directory (a run with no "
                                        "checkpoint there yet starts from scratch, so --save and --load may be the "
                                        "same), or from the one it names if it is an iter_NNNNNNN directory"})
    load_iteration: Optional[int] = field(
        default=None, metadata={"help": "resume from this iteration's checkpoint under --load instead of the latest"})
    load_optim: bool = field(default=True, metadata={
        "help": "restore optimizer states when loading (--no-load-optim: weights, schedule position and data position only)"})
    async_save: bool = field(
        default=False, metadata={"help": "fsdp2: write checkpoints in the background (torch.distributed.checkpoint's "
                                         "async_save): training goes on once the state is copied to host memory, and "
                                         "the checkpoint is published at the next sync (a single group: H steps later) "
                                         "once every rank has written; needs host memory for a copy of the rank's state"})
    keep_last: Optional[int] = field(
        default=None, metadata={"help": "keep only the newest N checkpoints (older ones are deleted after the new "
                                        "one is published); default: keep all"})
    ckpt_mode: str = field(
        default="exact", metadata={"help": "exact: every federation group's model and optimizer state (resumes bit "
                                           "for bit, F times one group's optimizer state); compact: sync first, then "
                                           "one model and group 0's optimizer state (resume is not exact)"})
    exit_interval: Optional[int] = field(
        default=None, metadata={"help": "save and exit after a step that is a multiple of this"})
    exit_duration_in_mins: Optional[float] = field(
        default=None, metadata={"help": "save and exit once the run has trained this many minutes"})
    exit_signal_handler: bool = field(
        default=False, metadata={"help": "on SIGTERM (what SLURM sends before it kills a job), every rank finishes "
                                         "its step, saves and exits 0"})
    init_from_hf: Optional[str] = field(
        default=None, metadata={"help": "start from a Hugging Face Llama or GPT-2 directory (continued pre-training); "
                                        "each rank reads only the rows it holds; ignored when --load finds a checkpoint"})

    @property
    def saving(self) -> bool:
        return self.save is not None

    def validate(self) -> None:
        errors = []
        for name in ("save_interval", "keep_last", "exit_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                errors.append(f"{name}={value} must be at least 1")
        if self.load_iteration is not None and (self.load is None or self.load_iteration < 0):
            errors.append(f"load_iteration={self.load_iteration} needs --load DIR and must be at least 0")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            errors.append(f"exit_duration_in_mins={self.exit_duration_in_mins} must be positive")
        if self.ckpt_mode not in CHECKPOINT_MODES:
            errors.append(f"ckpt_mode={self.ckpt_mode!r} is not one of {', '.join(CHECKPOINT_MODES)}")
        if self.save is None:
            needs_save = [f"{n}={getattr(self, n)}" for n in ("save_interval", "keep_last") if getattr(self, n) is not None]
            needs_save += ["async_save"] if self.async_save else []
            if needs_save:
                errors.append(f"{' and '.join(needs_save)} need --save DIR")
            if self.exit_signal_handler or self.exit_interval or self.exit_duration_in_mins:
                errors.append("exiting early (--exit-signal-handler, --exit-interval, --exit-duration-in-mins) "
                              "saves a checkpoint first: give --save DIR")
        if errors:
            raise ValueError("invalid checkpoint settings: " + "; ".join(errors))
