"""Network namespaces joined by veth pairs and a bridge, and the network faults on them.

`Net(tag)` makes a switch namespace `zc<tag>sw` holding a bridge, and per node a namespace
`zc<tag>-<node>` whose `eth0` is a veth pair's end, the other end on the bridge. Every name
starts with `zc<tag>`, so `Net.close` (and `remove_leftovers` for a run that died) finds
everything a run made. Nothing touches the host's own network namespace.

Faults (each undone by `heal`):
* `isolate(node)`: the node's port on the bridge goes down (cut from everything);
* `cut(a, b)`: blackhole routes both ways between two groups of nodes (a partition);
* `one_way(src, dst)`: a blackhole route in `src` only (src -> dst lost, dst -> src delivered);
* `lossy(node, fraction)`: a classic-BPF direct-action filter on the node's `eth0`, both ways,
  drops each packet with that probability (`ld rand`). This kernel has no `netem` qdisc
  (CONFIG_NET_SCH_NETEM unset), no act_gact and no iptables/nft binaries: cls_bpf with a
  classic program is what it has to drop packets at random;
* `slow(node, rate)`: a `tbf` qdisc on the node's `eth0` (a slow link: queueing delay up to
  `latency`, drops past it): the closest this kernel gets to `netem delay`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess

__all__ = ["CLONE_NEWNET", "Net", "enter", "remove_leftovers"]

CLONE_NEWNET = 0x40000000
SKF_AD_RANDOM = 0xFFFFF000 + 56
"""Classic BPF's `ld rand`: a random 32-bit number (SKF_AD_OFF + SKF_AD_RANDOM)."""


def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    """Run `ip [-n ns] args`; its stdout (raises on failure when `check`)."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def tc(ns: str, *args: str, check: bool = True) -> None:
    """Run `tc args` inside namespace `ns`."""
    argv = ["ip", "netns", "exec", ns, "tc", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def enter(ns: str) -> None:
    """Move the calling thread (the process, before it starts threads) into namespace `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def remove_leftovers(prefix: str = "zc") -> list[str]:
    """Delete every namespace whose name starts with `prefix` (a run that died); their names."""
    gone = []
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix):
            ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class Net:
    """A switch namespace with a bridge, and one namespace per node plugged into it."""

    SUBNET = "10.77.0"

    def __init__(self, tag: str) -> None:
        if not (tag.isalnum() and len(tag) <= 6):
            raise ValueError(f"tag {tag!r}: up to 6 letters or digits (interface names <= 15)")
        self.prefix = f"zc{tag}"
        self.sw = f"{self.prefix}sw"
        self.nodes: dict[str, tuple[str, str, str]] = {}
        """Node -> (namespace, address, its port on the bridge)."""
        self.faults: list[tuple[str, tuple[str, ...]]] = []
        ip("netns", "add", self.sw)
        ip("link", "add", "br0", "type", "bridge", ns=self.sw)
        ip("link", "set", "br0", "up", ns=self.sw)
        ip("link", "set", "lo", "up", ns=self.sw)

    def add(self, node: str) -> str:
        """Plug a new node in; returns its address."""
        i = len(self.nodes) + 1
        ns, addr, port = f"{self.prefix}-{node}", f"{self.SUBNET}.{i}", f"{self.prefix}p{i}"
        ip("netns", "add", ns)
        ip("link", "add", port, "netns", self.sw, "type", "veth", "peer", "name", "eth0",
           "netns", ns)
        ip("link", "set", port, "master", "br0", ns=self.sw)
        ip("link", "set", port, "up", ns=self.sw)
        ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        ip("link", "set", "eth0", "up", ns=ns)
        ip("link", "set", "lo", "up", ns=ns)
        self.nodes[node] = (ns, addr, port)
        return addr

    def ns(self, node: str) -> str:
        """The node's namespace."""
        return self.nodes[node][0]

    def addr(self, node: str) -> str:
        """The node's address."""
        return self.nodes[node][1]

    def exec(self, node: str) -> list[str]:
        """The argv prefix that runs a command in the node's namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    # ------------------------------------------------------------------ faults
    def isolate(self, node: str) -> None:
        """Cut the node from everything (its bridge port down)."""
        ip("link", "set", self.nodes[node][2], "down", ns=self.sw)
        self.faults.append(("isolate", (node,)))

    def cut(self, a: list[str], b: list[str]) -> None:
        """Partition group `a` from group `b` (both directions)."""
        for x in a:
            for y in b:
                self._blackhole(x, y)
                self._blackhole(y, x)

    def one_way(self, src: str, dst: str) -> None:
        """Lose every packet from `src` to `dst`; the other way is delivered."""
        self._blackhole(src, dst)

    def _blackhole(self, src: str, dst: str) -> None:
        ip("route", "add", "blackhole", f"{self.addr(dst)}/32", ns=self.ns(src))
        self.faults.append(("route", (src, dst)))

    def lossy(self, node: str, fraction: float) -> None:
        """Drop each packet in and out of the node with probability `fraction`."""
        threshold = min(2**32 - 1, max(0, round((1 - fraction) * 2**32)))
        program = f"4,32 0 0 {SKF_AD_RANDOM},53 0 1 {threshold},6 0 0 2,6 0 0 0"
        ns = self.ns(node)
        tc(ns, "qdisc", "add", "dev", "eth0", "clsact")
        self.faults.append(("clsact", (node,)))
        for way in ("egress", "ingress"):
            tc(ns, "filter", "add", "dev", "eth0", way, "bpf", "da", "bytecode", program)

    def slow(self, node: str, rate: str = "256kbit", latency: str = "300ms") -> None:
        """A slow link out of the node: queueing delay up to `latency`, drops past it."""
        tc(self.ns(node), "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
           "burst", "4kb", "latency", latency)
        self.faults.append(("tbf", (node,)))

    def heal(self) -> None:
        """Undo every fault (the last first)."""
        while self.faults:
            what, args = self.faults.pop()
            with contextlib.suppress(RuntimeError):
                if what == "isolate":
                    ip("link", "set", self.nodes[args[0]][2], "up", ns=self.sw)
                elif what == "route":
                    ip("route", "del", "blackhole", f"{self.addr(args[1])}/32",
                       ns=self.ns(args[0]))
                elif what == "clsact":
                    tc(self.ns(args[0]), "qdisc", "del", "dev", "eth0", "clsact")
                elif what == "tbf":
                    tc(self.ns(args[0]), "qdisc", "del", "dev", "eth0", "root")

    def close(self) -> None:
        """Delete every namespace of this net (their links go with them)."""
        for ns, _, _ in self.nodes.values():
            ip("netns", "del", ns, check=False)
        ip("netns", "del", self.sw, check=False)
        self.nodes.clear()
