"""What an elastic launcher shows while its groups run: the lines of each group's log
(RUN_DIR/launch/group_G.log) worth a look, followed as the files grow, and each group's last word.

The texts are those the ranks print (fl_megatron/training: trainer.py, healing.py's
MembershipLog, console.py; fl_megatron/pretrain.py's errors) and torchrun's own about a failed
worker. `select_line` is the choice, a pure function of one line.
"""

import re
from pathlib import Path
from typing import Callable, Optional

PROGRESS = re.compile(r"(?:group \d+ )?(step +\d+/\d+ \|.*|eval at step \d+: .*)")
EVENTS = (re.compile(r"step \d+: "),                        # left, joined, healed, voted down, sick groups
          re.compile(r"group \d+: (joined|healed|behind) "),  # a group meeting the others or healing
          re.compile(r"group \d+: \d+ s waiting for "),      # a wait on the lighthouse, every 30 s (elastic/waiting.py)
          re.compile(r"stopping after step "),                # a stop (too few groups, SIGTERM, --exit-*)
          re.compile(r"fl-megatron: injected fault"))
ERRORS = (re.compile(r"fl_megatron\.pretrain: error: "),
          re.compile(r"(\[rank\d+\]: *)?[A-Za-z_][\w.]*(Error|Exception): \S"))  # an uncaught exception
SIGNALLED = "SignalException"  # torchrun told to stop (by the launcher itself, or whoever signalled it)
TORCHRUN = re.compile(r"[EWI]\d{4} [\d:.]+ +\d+ \S+\] (.*)")  # torch.distributed.elastic's log lines
TORCHRUN_FAILED = re.compile(r"failed \(exitcode")
TORCHRUN_RESTART = re.compile(r"will restart worker group|attempts left")
BANNER = "fl-megatron pretrain"   # a rank 0 starting: the job's first start, or torchrun's restart
DONE = re.compile(r"done: \d+ steps in ")


def select_line(group: int, line: str, progress_of: int = 0) -> Optional[tuple[str, str]]:
    """(kind, text) to show of one line of group `group`'s log, or None. Kinds: "progress"
    (group `progress_of` only: its step and evaluation lines), "event" (membership, heals,
    stops, restarts), "error" (the ranks'), "failed" (torchrun's: a worker failed), "start"
    (the banner) and "final" (the `done:` summary line)."""
    text = line.strip()
    if group == progress_of and (m := PROGRESS.fullmatch(text)):
        return "progress", m.group(1)
    if any(p.match(text) for p in EVENTS):
        return "event", text.removeprefix(f"group {group}: ")
    if any(p.match(text) for p in ERRORS):
        return None if SIGNALLED in text else ("error", text)
    if m := TORCHRUN.fullmatch(text):
        message = m.group(1)
        if TORCHRUN_FAILED.search(message):
            return "failed", "torchrun: " + message
        if TORCHRUN_RESTART.search(message):
            return "event", "torchrun: " + message
        return None
    if text == BANNER:
        return "start", text
    if DONE.match(text):
        return "final", text
    return None


class GroupLogs:
    """Follows the groups' logs ({group: path}; a file may not exist yet) and passes each line
    select_line picks to `out` as `[group G] text`; a second banner shows as a restart."""

    def __init__(self, paths: dict[int, Path], out: Callable[[str], None], progress_of: int = 0):
        self.paths, self.out, self.progress_of = dict(paths), out, progress_of
        self.offsets = {g: 0 for g in paths}
        self.partial = {g: b"" for g in paths}
        self.starts = {g: 0 for g in paths}
        self.last = {g: None for g in paths}  # the latest `done:` or error line of the group's ranks
        self.failed = {g: None for g in paths}  # torchrun's latest line about a failed worker

    def poll(self, flush: bool = False) -> None:
        """Show what the logs gained since the last poll; flush: an unfinished last line too."""
        for g in self.paths:
            for line in self._new_lines(g, flush):
                self._show(g, line)

    def _new_lines(self, g: int, flush: bool) -> list[str]:
        try:
            with open(self.paths[g], "rb") as f:
                f.seek(self.offsets[g])
                data = f.read()
        except FileNotFoundError:
            return []
        self.offsets[g] += len(data)
        lines = (self.partial[g] + data).split(b"\n")
        self.partial[g] = b"" if flush else lines.pop()
        return [line.decode(errors="replace") for line in lines if line.strip()]

    def _show(self, g: int, line: str) -> None:
        picked = select_line(g, line, self.progress_of)
        if picked is None:
            return
        kind, text = picked
        if kind == "start":  # what the last attempt says counts
            self.starts[g] += 1
            self.last[g] = self.failed[g] = None
            if self.starts[g] > 1:
                self.out(f"[group {g}] restarted by torchrun (attempt {self.starts[g]})")
            return
        if kind in ("final", "error"):
            self.last[g] = text
        if kind == "failed":
            self.failed[g] = text
        if kind != "final":
            self.out(f"[group {g}] {text}")

    def final_lines(self, codes: dict[int, Optional[int]]) -> list[str]:
        """Per group of `codes` (the started ones): its exit code (None: stopped while running)
        and the last word of its last attempt: the ranks' `done:` or error line, else torchrun's."""
        lines = []
        for g, code in codes.items():
            last = self.last[g] or self.failed[g]
            if code is None:
                lines.append(f"[group {g}] stopped while running" + (f" (its last word: {last})" if last else ""))
            else:
                lines.append(f"[group {g}] exit code {code}: {last or f'no summary line (see {self.paths[g]})'}")
        return lines
