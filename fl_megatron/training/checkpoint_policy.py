"""When a run saves: every --save-interval steps, at the end and before stopping early. An
overlapped sync in flight lands first (and is recorded). A checkpoint written in the background
(--async-save) is published at the first sync after it, where the groups meet anyway, or H steps
after it for a single group or groups that never sync, and before leaving."""

from typing import Callable, Optional

from ..checkpoint import Checkpointer
from .failures import PhaseTracker


class CheckpointPolicy:
    """The save decisions of one rank's loop (every rank decides the same)."""

    def __init__(self, checkpointer: Checkpointer, engine, options, train_iters: int, phases: PhaseTracker,
                 reporter, tuning, say: Callable[[str], None], session) -> None:
        self.checkpointer, self.engine, self.options, self.session = checkpointer, engine, options, session
        self.train_iters, self.phases, self.reporter, self.tuning, self.say = train_iters, phases, reporter, tuning, say

    def after_step(self, done: int, stopped: Optional[str], lr: float, due: Optional[bool] = None) -> None:
        """After optimizer step `done` (and its records): publish what is due, save what is due.
        `due`: whether a save is due, where the caller decides (per-group step counts save at the
        syncs, `done` being the round's federation step)."""
        if self.checkpointer.pending is not None and self._publish_due(done):
            self._publish_pending(done)
        options = self.options
        if due is None:
            due = done == self.train_iters or bool(options.save_interval and done % options.save_interval == 0)
        if options.saving and (due or stopped):
            self.phases.enter("checkpoint-write", done)
            if self.engine.flight is not None:  # a sync in flight lands before the save; it is recorded
                landed = self.engine.land()  # (elastic: committed or voted down here)
                self.tuning.saw_landing(landed)
                self.session.after_sync(landed)
                self.reporter.landing(done, landed, lr, "landed_for_checkpoint")
            path = self.checkpointer.save(done)
            if self.checkpointer.pending is None:
                self.say(f"  saved checkpoint {path}")
            else:
                self.say(f"  checkpoint of step {done} staged, being written in the background")

    def finish(self, done: int) -> None:
        """The last checkpoint written in the background (or a stop's) is published before leaving."""
        if self.checkpointer.pending is not None:
            self._publish_pending(done)

    def _publish_due(self, done: int) -> bool:
        """Whether a checkpoint written in the background is published after step `done`."""
        vote, pending = self.engine.vote, self.checkpointer.pending
        if self.engine.active:
            return vote is not None and vote.step == done and done > pending.iteration
        return done >= pending.iteration + self.engine.config.sync_interval

    def _publish_pending(self, done: int) -> None:
        self.phases.enter("checkpoint-write", done)
        path = self.checkpointer.finish_pending()
        self.say(f"  saved checkpoint {path} (written in the background)")
