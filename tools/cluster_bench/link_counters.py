"""Per-node traffic counters of the emulated links.

Two views of the same traffic, both per node and per direction:
- `tx_bytes`/`rx_bytes`/`*_packets`: the kernel's counters of the node's `eth0`. veth passes
  GSO super-packets (up to 64 KiB), which it counts as one packet with one set of headers,
  so these undercount the TCP/IP/Ethernet framing of a real 1500-byte-MTU wire (by ~4 %)
  whenever tbf does not split them: always when unshaped, and when the tbf burst exceeds
  64 KiB (above ~530 Mbit/s with the default burst_ms=1).
- `wire_*`: the counters of the root qdisc on each end of the link (tbf when shaped, pfifo
  otherwise). The kernel counts GSO packets there per segment with every segment's headers,
  i.e. Ethernet frames without FCS/preamble: the bytes a real NIC would put on the wire and
  the bytes the shaper charges against the rate. `wire_*_drops` are packets the qdisc dropped.
"""

import dataclasses
import json

from cluster_bench.netns_ops import sh


@dataclasses.dataclass(frozen=True)
class LinkCounters:
    """Traffic of one node's link; subtract two snapshots to get a delta."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    wire_tx_bytes: int
    wire_rx_bytes: int
    wire_tx_packets: int
    wire_rx_packets: int
    wire_tx_drops: int
    wire_rx_drops: int

    def __sub__(self, other: "LinkCounters") -> "LinkCounters":
        return LinkCounters(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                    dataclasses.astuple(other))))

    def as_dict(self) -> dict[str, int]:
        """Plain dict, e.g. for JSON output."""
        return dataclasses.asdict(self)


def _root_qdisc(ns: str, dev: str | None = None) -> dict[str, dict]:
    """Root qdisc stats per device of a namespace (`tc -s -j qdisc show`)."""
    argv = ["tc", "-n", ns, "-s", "-j", "qdisc", "show"] + (["dev", dev] if dev else [])
    return {q.get("dev", dev): q for q in json.loads(sh(argv) or "[]") if q.get("root")}


def _link_stats(ns: str, dev: str) -> dict:
    """stats64 of one device (`ip -s -j link show`)."""
    [link] = json.loads(sh(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]))
    return link["stats64"]


def read_counters(bridge_ns: str, node_ns: list[str]) -> list[LinkCounters]:
    """Snapshot of every node's counters; node k's rx qdisc is `v<k>` in the bridge namespace."""
    bridge_q = _root_qdisc(bridge_ns)
    result = []
    for k, ns in enumerate(node_ns):
        stats = _link_stats(ns, "eth0")
        tx_q = _root_qdisc(ns, "eth0").get("eth0", {})
        rx_q = bridge_q.get(f"v{k}", {})
        result.append(LinkCounters(
            tx_bytes=stats["tx"]["bytes"], rx_bytes=stats["rx"]["bytes"],
            tx_packets=stats["tx"]["packets"], rx_packets=stats["rx"]["packets"],
            wire_tx_bytes=tx_q.get("bytes", 0), wire_rx_bytes=rx_q.get("bytes", 0),
            wire_tx_packets=tx_q.get("packets", 0), wire_rx_packets=rx_q.get("packets", 0),
            wire_tx_drops=tx_q.get("drops", 0), wire_rx_drops=rx_q.get("drops", 0)))
    return result
