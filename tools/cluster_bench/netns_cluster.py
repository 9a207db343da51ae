"""An emulated two-tier cluster: one network namespace per node, shaped links between nodes.

    with EmulatedCluster(nodes=2, rate_mbit=100) as cluster:
        if cluster.note:
            print(cluster.note)          # the run is unshaped (loopback fallback), and why
        result = run_job(cluster, ranks_per_node=2, args=["-m", "fl_megatron.pretrain", ...])

Node k is namespace `<prefix>-n<k>` with `lo` (ranks of one node) and `eth0` (a veth into a
bridge namespace `<prefix>-br`, address 198.18.0.<k+1>/15, no default route). With a rate,
tbf shapes both ends of each veth: a full-duplex link of that rate per node. Needs root and
`ip netns`; otherwise (or with mode="loopback") everything runs unshaped on 127.0.0.1.
With node_hostnames=True each node also gets its own host name (`<prefix>-n<k>`, a UTS
namespace per started process) that every node resolves to the node's address (a hosts file
per namespace): for software that advertises `socket.gethostname()` to its peers (torchft's
checkpoint transport, torchrun's c10d rendezvous), which would otherwise name a loopback
address that other nodes cannot reach.
Everything created is removed on exit, on exceptions and on SIGINT/SIGTERM; after a SIGKILL
the next cluster's start removes the leftovers (see stale_cleanup).
"""

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from cluster_bench.cluster_jobs import JobResult, run_job, torchrun_command
from cluster_bench.link_counters import LinkCounters, read_counters
from cluster_bench.netns_ops import (NetnsError, add_namespace, build_bridge, configure_node,
                                     delete_namespace, namespace_pids, node_address, quiet_ipv6,
                                     set_root_qdisc, tbf_params, write_hosts_file)
from cluster_bench.stale_cleanup import cleanup_stale
from fl_megatron.launching.ports import free_port
from fl_megatron.launching.tree import stop_all

__all__ = ["EmulatedCluster", "JobResult", "LinkCounters", "cleanup_stale", "run_job",
           "torchrun_command"]
MODES = ("auto", "netns", "loopback")
_SEQ = itertools.count()


class EmulatedCluster:
    """Context manager for an emulated cluster of `nodes` nodes linked at `rate_mbit` (None:
    unshaped). mode: "auto" (netns if possible, else loopback), "netns" (raise if not
    possible) or "loopback". After entering, `mode` is "netns" or "loopback" and `note` is
    None or explains why the run is unshaped. burst_ms/queue_ms size the token buckets;
    node_hostnames: a host name per node (netns mode; see the module's docstring)."""

    def __init__(self, nodes: int, rate_mbit: float | None = None, *, mode: str = "auto",
                 mtu: int = 1500, burst_ms: float = 1.0, queue_ms: float = 50.0,
                 handle_signals: bool = True, node_hostnames: bool = False):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.nodes = nodes
        self.rate_mbit = rate_mbit
        self.requested_mode = mode
        self.mtu = mtu
        self.tbf = None if rate_mbit is None else tbf_params(rate_mbit, mtu, burst_ms, queue_ms)
        self.prefix = f"flm{os.getpid()}x{next(_SEQ)}"
        self.mode: str | None = None
        self.note: str | None = None
        self.setup_seconds: float | None = None
        self.teardown_seconds: float | None = None
        self._handle_signals = handle_signals
        self.node_hostnames = node_hostnames
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        self._ports = itertools.count(29500)
        self._closing = self._closed = False
        self._pending_signal: int | None = None

    # ----- names and addresses
    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def node_ns(self, k: int) -> str:
        """Name of node k's network namespace (netns mode)."""
        return f"{self.prefix}-n{k}"

    def node_ip(self, k: int) -> str:
        """Address other nodes reach node k at."""
        self._check_node(k)
        return node_address(k) if self.mode == "netns" else "127.0.0.1"

    def node_host(self, k: int) -> str:
        """Host name (netns mode with node_hostnames) or address other nodes reach node k at."""
        self._check_node(k)
        return self.node_ns(k) if self.mode == "netns" and self.node_hostnames else self.node_ip(k)

    def node_prefix(self, k: int) -> list[str]:
        """Command prefix that runs a command on node k: empty on loopback; `ip netns exec` into
        its namespace, and with node_hostnames in a UTS namespace of its own named node_host(k)."""
        self._check_node(k)
        if self.mode != "netns":
            return []
        prefix = ["ip", "netns", "exec", self.node_ns(k)]
        if self.node_hostnames:
            prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.node_host(k)]
        return prefix

    def pick_port(self) -> int:
        """A free TCP port for a rendezvous on node 0 (a new one per call)."""
        self._check_active()
        if self.mode == "netns":
            return next(self._ports)  # node 0's namespace is ours alone
        return free_port()

    # ----- lifecycle
    def __enter__(self) -> "EmulatedCluster":
        if self.mode is not None or self._closed:
            raise RuntimeError("an EmulatedCluster can be entered only once")
        self._install_handlers()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except NetnsError as err:
            if exc_type is None:
                raise
            print(f"EmulatedCluster: {err}", file=sys.stderr)

    def _start(self) -> None:
        reason = "mode='loopback' was requested" if self.requested_mode == "loopback" \
            else self._netns_unavailable()
        if reason is None:
            try:
                self._setup_netns()
                self.mode = "netns"
                return
            except (NetnsError, OSError) as err:
                if self.requested_mode == "netns":
                    raise
                self._delete_namespaces()
                reason = f"setting up namespaces failed: {err}"
        if self.requested_mode == "netns":
            raise NetnsError(f"netns mode is not available: {reason}")
        self.mode = "loopback"
        rate = "unshaped" if self.rate_mbit is None else \
            f"NOT shaped to the requested {self.rate_mbit:g} Mbit/s"
        self.note = (f"emulated cluster fell back to loopback ({reason}): all {self.nodes} nodes "
                     f"run on 127.0.0.1, inter-node traffic is {rate} and not counted")

    def _netns_unavailable(self) -> str | None:
        if os.geteuid() != 0:
            return "not running as root"
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        return f"{' and '.join(missing)} (iproute2) not found" if missing else None

    def _setup_netns(self) -> None:
        start = time.perf_counter()
        try:
            cleanup_stale()
        except NetnsError:
            pass
        nodes = [self.node_ns(k) for k in range(self.nodes)]
        for ns in [self.bridge_ns, *nodes]:
            add_namespace(ns)
            self._namespaces.append(ns)
            self._check_not_closed()
        for ns in [self.bridge_ns, *nodes]:
            quiet_ipv6(ns)
        build_bridge(self.bridge_ns, nodes, self.mtu)
        for k, ns in enumerate(nodes):
            configure_node(ns, k)
            set_root_qdisc(ns, "eth0", self.tbf)
            set_root_qdisc(self.bridge_ns, f"v{k}", self.tbf)
            self._check_not_closed()
        if self.node_hostnames:
            names = {ns: node_address(k) for k, ns in enumerate(nodes)}
            for ns in nodes:
                write_hosts_file(ns, names)
        self.setup_seconds = time.perf_counter() - start

    def close(self) -> None:
        """Stop every process started here and delete every namespace created here."""
        if self._closing or self._closed:
            return
        self._closing = True
        start = time.perf_counter()
        try:
            extra = [p for ns in self._namespaces for p in namespace_pids(ns)]
            stop_all(self._procs, extra=extra)
            self._delete_namespaces()
        finally:
            self._closed, self._closing = True, False
            self.teardown_seconds = time.perf_counter() - start
            self._restore_handlers()
            if self._pending_signal is not None:
                signal.raise_signal(self._pending_signal)

    def _delete_namespaces(self) -> None:
        errors = []
        for ns in reversed(self._namespaces):
            try:
                delete_namespace(ns)
            except NetnsError as err:
                errors.append(str(err))
        self._namespaces.clear()
        if errors:
            raise NetnsError("teardown incomplete: " + "; ".join(errors))

    # ----- signals
    def _install_handlers(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._old_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        """Tear down, then deliver the signal again to the previous handler."""
        if self._closing:
            self._pending_signal = signum
            return
        try:
            self.close()
        except NetnsError as err:
            print(f"EmulatedCluster: {err}", file=sys.stderr)
        signal.raise_signal(signum)

    # ----- processes and counters
    def popen(self, k: int, argv: list[str], env: dict | None = None,
              **kw) -> subprocess.Popen:
        """Start argv on node k (behind node_prefix(k), with GLOO_SOCKET_IFNAME=eth0 in netns
        mode), in a new session so that close() can stop it with all its children. kw go to
        subprocess.Popen; env defaults to this process's environment."""
        self._check_node(k)
        if kw.keys() & {"start_new_session", "process_group", "preexec_fn"}:
            raise ValueError("popen() starts each process in its own session itself")
        env = dict(os.environ if env is None else env)
        if self.mode == "netns":
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            argv = [*self.node_prefix(k), *argv]
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
        """SIGTERM procs (started by popen) with their children, SIGKILL after grace_s."""
        stop_all(list(procs), grace_s=grace_s)

    def counters(self) -> list[LinkCounters] | None:
        """Per-node counters of eth0 (see link_counters); None in loopback mode."""
        self._check_active()
        if self.mode != "netns":
            return None
        return read_counters(self.bridge_ns, [self.node_ns(k) for k in range(self.nodes)])

    def describe(self) -> dict:
        """Settings of this cluster, for a benchmark's report."""
        return {"mode": self.mode, "nodes": self.nodes, "rate_mbit": self.rate_mbit,
                "tbf": self.tbf if self.mode == "netns" else None, "mtu": self.mtu,
                "note": self.note, "setup_seconds": self.setup_seconds,
                "node_hostnames": self.node_hostnames and self.mode == "netns"}

    def _check_active(self) -> None:
        if self.mode is None or self._closed:
            raise RuntimeError("the cluster is not active (use it inside its `with` block)")

    def _check_not_closed(self) -> None:
        if self._closed:
            raise RuntimeError("the cluster was torn down (signal) while it was being set up")

    def _check_node(self, k: int) -> None:
        self._check_active()
        if not 0 <= k < self.nodes:
            raise IndexError(f"node {k} out of range for a cluster of {self.nodes} nodes")
