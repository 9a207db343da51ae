"""Thin wrappers around `ip` and `tc` for building and removing the emulated network.

Layout per cluster: one bridge namespace `<prefix>-br` holding `br0` and the bridge ends
`v<k>` of the veths; node namespaces `<prefix>-n<k>` holding `lo` and `eth0`. Every link
lives inside our own namespaces, so nothing is added to the host's namespace.
"""

import ipaddress
import math
import shutil
import subprocess
from pathlib import Path

MIN_QUEUE_BYTES = 512 * 1024
SUBNET = ipaddress.ip_network("198.18.0.0/15")  # benchmarking range (RFC 2544), no route out


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message carries the command and its stderr."""


def sh(argv: list[str], *, stdin: str | None = None, check: bool = True) -> str:
    """Run one command, return its stdout; raise NetnsError with stderr when it fails."""
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list`)."""
    return [line.split()[0] for line in sh(["ip", "netns", "list"]).splitlines() if line.strip()]


def add_namespace(name: str) -> None:
    """Create a named network namespace."""
    sh(["ip", "netns", "add", name])


def delete_namespace(name: str) -> None:
    """Delete a named network namespace; its interfaces and its /etc/netns files go with it."""
    sh(["ip", "netns", "del", name])
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts NETNS_ETC/NAME/* over /etc/*


def write_hosts_file(ns: str, entries: dict[str, str]) -> None:
    """/etc/hosts as processes started by `ip netns exec ns` see it: localhost and `entries`
    (name -> address). Removed with the namespace (delete_namespace)."""
    folder = NETNS_ETC / ns
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
             *(f"{address} {name}" for name, address in entries.items())]
    (folder / "hosts").write_text("\n".join(lines) + "\n")


def namespace_pids(name: str) -> list[int]:
    """PIDs of the processes running inside a namespace (empty if it is gone)."""
    out = sh(["ip", "netns", "pids", name], check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def node_address(k: int) -> str:
    """IP address of node k (198.18.0.1 for node 0, ...)."""
    return str(SUBNET[k + 1])


def quiet_ipv6(ns: str) -> None:
    """Disable IPv6 in a namespace so router solicitations etc. do not pollute the counters."""
    script = ("for f in all default; do echo 1 > /proc/sys/net/ipv6/conf/$f/disable_ipv6; done"
              " 2>/dev/null; true")
    sh(["ip", "netns", "exec", ns, "sh", "-c", script])


def build_bridge(bridge_ns: str, node_ns: list[str], mtu: int) -> None:
    """Create br0 in the bridge namespace and one veth per node (`v<k>` <-> node's `eth0`)."""
    lines = ["link set lo up", "link add br0 type bridge", f"link set br0 mtu {mtu} up"]
    for k, ns in enumerate(node_ns):
        lines += [f"link add v{k} mtu {mtu} type veth peer name eth0 mtu {mtu} netns {ns}",
                  f"link set v{k} master br0", f"link set v{k} up"]
    sh(["ip", "-n", bridge_ns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def configure_node(ns: str, k: int) -> None:
    """Bring up lo and eth0 of node k and give eth0 its address (no default route)."""
    lines = ["link set lo up", f"addr add {node_address(k)}/{SUBNET.prefixlen} dev eth0",
             "link set eth0 up"]
    sh(["ip", "-n", ns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def tbf_params(rate_mbit: float, mtu: int, burst_ms: float, queue_ms: float) -> dict[str, int]:
    """Token-bucket sizes in bytes for a rate.

    burst: `burst_ms` worth of tokens but at least 4 full frames, so an idle link never saves
    up more than about a millisecond of traffic (GSO packets larger than the burst are
    segmented by tbf, which is cheap below ~500 Mbit/s where this applies).
    limit: the burst plus `queue_ms` of queue, at least MIN_QUEUE_BYTES: with a shallower
    queue TCP overflows it during multi-MiB gloo messages at <= 100 Mbit/s, and every drop
    can cost a 200 ms retransmission timeout (measured: drops gone from 256-512 KiB up).
    """
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(math.ceil(bytes_per_s * burst_ms / 1e3), 4 * (mtu + 14))
    limit = burst + max(math.ceil(bytes_per_s * queue_ms / 1e3), MIN_QUEUE_BYTES)
    return {"rate_bit": math.ceil(rate_mbit * 1e6), "burst": burst, "limit": limit}


def set_root_qdisc(ns: str, dev: str, tbf: dict[str, int] | None) -> None:
    """Shape `dev` with tbf, or (tbf None) add a plain pfifo just to get wire-size counters."""
    if tbf is None:
        qdisc = ["pfifo", "limit", "10000"]
    else:
        qdisc = ["tbf", "rate", f"{tbf['rate_bit']}bit", "burst", str(tbf["burst"]),
                 "limit", str(tbf["limit"])]
    sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc])
