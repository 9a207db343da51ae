"""While a group waits on the lighthouse (its manager reaching it, a quorum, a heal), one thread per
rank that keeps the wait from being silent and, until the group's first meeting, refuses a
federation whose groups do not match.

The group's first rank reads the lighthouse's status page every second: it compares the settings
in the other groups' replica ids with its own (see signature.py) and leaves at a mismatch (see
refusal.py); every `every_s` of a wait it prints what it waits for, at which address, and who
heartbeats; where nothing answers at the address it says so within `problem_after_s`. The other
ranks only look, every second, for a refusal their first rank published.
"""

import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional
from urllib.parse import urlparse

from .lighthouse_status import heartbeating_replicas
from .refusal import Refusal
from .signature import Signature, mismatch_text, parse_replica_id

MET_GRACE_S = 10.0


def lighthouse_address(lighthouse: str) -> tuple[str, int]:
    """(host, port) of a lighthouse given as HOST:PORT or a URL."""
    parsed = urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    return parsed.hostname or "", parsed.port or 80


def lighthouse_problem(lighthouse: str, timeout_s: float = 3.0) -> Optional[str]:
    """None when something accepts connections at the lighthouse's address, else what is wrong."""
    host, port = lighthouse_address(lighthouse)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return "nothing listens there (connection refused)"
    except socket.gaierror as e:
        return f"the host name {host!r} does not resolve ({e.strerror})"
    except (socket.timeout, TimeoutError):
        return f"nothing answers there within {timeout_s:g} s (a firewall, or the wrong host)"
    except OSError as e:
        return f"it cannot be reached ({e.strerror or e})"


class WaitWatch:
    """One rank's watch over its group's waits. `say`: prints a line (the first rank's console);
    `refusal`: how the group leaves at a mismatch (None: nobody refuses, e.g. in tests)."""

    def __init__(self, lighthouse: str, group: int, signature: Signature, job_rank: int,
                 say: Callable[[str], None], refusal: Optional[Refusal] = None, every_s: float = 30.0,
                 poll_s: float = 1.0, problem_after_s: float = 5.0) -> None:
        self.lighthouse, self.group, self.signature = lighthouse, group, signature
        self.reporter = job_rank == 0
        self._say, self._refusal = say, refusal
        self.every_s, self.poll_s, self.problem_after_s = every_s, poll_s, problem_after_s
        self._lock = threading.Lock()
        self._what: Optional[Callable[[], str]] = None  # what the current wait is for
        self._since = 0.0
        self._told = 0.0          # when the current wait was last reported
        self._met_at: Optional[float] = None  # when the group's first meeting ended
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fl-megatron-wait-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self, what: Callable[[], str]):
        """Watch the wait inside the block; `what()` says what it is for (called by the thread)."""
        with self._lock:
            self._what, self._since, self._told = what, time.monotonic(), 0.0
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._what = None

    def met(self) -> None:
        """The group's first meeting is over: from here on nobody is refused. The other ranks
        still look for a refusal for `MET_GRACE_S`: their first rank checks once more after it."""
        self._met_at = time.monotonic()

    def _refusing(self) -> bool:
        if self._refusal is None or self._met_at is None:
            return self._refusal is not None
        return not self.reporter and time.monotonic() < self._met_at + MET_GRACE_S

    def check_now(self) -> None:
        """The first rank, on the caller's thread: leave now if a heartbeating group differs."""
        if not (self.reporter and self._refusing()):
            return
        try:
            replicas = self._replicas()
        except (OSError, ValueError):
            return  # unreadable now: the thread keeps looking, and says why when it lasts
        self._compare(replicas)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # --- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            refusing = self._refusing()
            with self._lock:
                what, since = self._what, self._since
            if not refusing and (what is None or not self.reporter):
                self._wake.wait()  # until a wait begins (or close)
                self._wake.clear()
                continue
            try:
                self._tick(refusing, what, since)
            except Exception as e:  # noqa: BLE001 - a watch must never end the run it watches
                if self.reporter:
                    self._say(f"  group {self.group}: the wait watch could not read the lighthouse ({e})")
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _tick(self, refusing: bool, what: Optional[Callable[[], str]], since: float) -> None:
        if not self.reporter:  # only looks for its first rank's refusal
            line = self._refusal.published()
            if line is not None:
                self._refusal.leave(line)
            return
        now = time.monotonic()
        waited = now - since
        # a line is due every every_s of a wait; where the lighthouse does not answer, from problem_after_s
        due = what is not None and (now - self._told >= self.every_s if self._told else waited >= self.problem_after_s)
        if not (refusing or due):
            return
        replicas, problem = None, None
        try:
            replicas = self._replicas()
        except (OSError, ValueError) as e:
            problem = e
        if refusing and replicas is not None:
            self._compare(replicas)
        if due and (problem is not None or self._told or waited >= self.every_s):
            self._told = now
            self._say(self._line(what(), waited, replicas, problem))

    def _replicas(self) -> list:
        return heartbeating_replicas(self.lighthouse, timeout_s=min(5.0, self.every_s))

    def _compare(self, replicas: list) -> None:
        """Leave if a heartbeating group differs, once this group heartbeats too: the other side
        then sees this group's settings for at least the lighthouse's heartbeat timeout, and
        refuses in turn (a group that left before the others could see it would leave them
        waiting)."""
        own = self.signature.replica_id(self.group) + ":"
        if not any(replica.startswith(own) for replica in replicas):
            return
        others = {}
        for replica in replicas:
            parsed = parse_replica_id(replica)
            if parsed is not None and parsed[0] != self.group:
                others[parsed[0]] = parsed[1]
        text = mismatch_text(self.signature, self.group, others)
        if text is not None and self._refusal is not None:
            self._refusal.leave(f"group {self.group}: the federation's groups do not match: {text}. Every group "
                                "must run with the same settings (groups of unequal size: give every group the same "
                                "--fl-group-sizes); compare the groups' config.json")

    def _line(self, what: str, waited: float, replicas: Optional[list], problem: Optional[Exception]) -> str:
        head = f"  group {self.group}: {waited:.0f} s waiting for {what}, at the lighthouse {self.lighthouse}"
        if problem is None:
            slots = sorted({p[0] for p in map(parse_replica_id, replicas or []) if p is not None})
            return head + f"; heartbeating now: group(s) {', '.join(map(str, slots)) or 'none'}"
        reason = lighthouse_problem(self.lighthouse) or f"its status page does not answer ({problem})"
        return (head + f": {reason}; check --fl-lighthouse (or TORCHFT_LIGHTHOUSE) and that torchft_lighthouse "
                       "runs on that host and port")
