"""What to inject: frozen, keyword-only specs validated on construction.

A spec says what and where and how strong; when and how long live in
:class:`greyhound.inject.schedule.Planned`. Specs only check their own values; whether
the target exists on this machine is checked by the injectors' ``preflight``.
"""

from __future__ import annotations

import dataclasses
import re

SEVERITY_MAX = 0.95
"""The largest CPU fraction a compute injection may take: a rank kept at 5% of a CPU
still answers signals and heartbeats, one at 0% would look dead rather than slow."""

DEFAULT_SEVERITY = 0.5

_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_SCALE_BPS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_SIZE = re.compile(r"^([0-9]+)(b|kb|k|mb|m)?$")
_SIZE_SCALE = {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}
_TIME = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|us|s)$")
_TIME_SCALE_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NODE = re.compile(r"^n([0-9]+)$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_NETNS = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

NODE_NETNS = "gh-n{num}"
"""Namespace of emulated node nX under ``scripts/cluster up --netns``."""
NODE_HOST_DEV = "gh-veth{num}"
"""Host-side veth of node nX (its bridge port)."""
NODE_DEV = "eth0"
"""Node-side end of that veth, inside the node's namespace."""


def parse_rate_bps(rate: str) -> float:
    """tc rate text ('200mbit', '25mbps') to bits per second; ValueError if malformed.

    Units as tc reads them: *bit are bits per second, *bps are bytes per second.
    """
    match = _RATE.match(rate.strip().lower())
    if not match:
        raise ValueError(
            f"rate {rate!r} is not a tc rate; use a number and a unit "
            "(bit, kbit, mbit, gbit; bps, kbps, mbps, gbps = bytes/s), e.g. 200mbit"
        )
    bps = float(match.group(1)) * _RATE_SCALE_BPS[match.group(2)]
    if bps < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit; tbf cannot shape that slowly")
    return bps


def parse_size_bytes(size: str) -> int:
    """tc size text ('64kb', '1m', '32768') to bytes; ValueError if malformed."""
    match = _SIZE.match(size.strip().lower())
    if not match:
        raise ValueError(f"size {size!r} is not a byte count; use e.g. 65536, 64kb or 1mb")
    return int(match.group(1)) * _SIZE_SCALE[match.group(2)]


def parse_time_s(text: str) -> float:
    """tc time text ('50ms', '1s') to seconds; ValueError if malformed."""
    match = _TIME.match(text.strip().lower())
    if not match:
        raise ValueError(f"time {text!r} is not a tc time; use e.g. 50ms, 500us or 1s")
    return float(match.group(1)) * _TIME_SCALE_S[match.group(2)]


def node_links(node: str) -> tuple[tuple[str | None, str], tuple[str, str]]:
    """((None, host-side veth), (netns, node-side dev)) of emulated node 'nX'."""
    match = _NODE.match(node)
    if not match:
        raise ValueError(f"node {node!r} is not an emulated node name; use nX, e.g. n2")
    num = match.group(1)
    return (None, NODE_HOST_DEV.format(num=num)), (NODE_NETNS.format(num=num), NODE_DEV)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ComputeSpec:
    """Take a fraction of the CPU from one process, or from every process of a rank."""

    severity: float = DEFAULT_SEVERITY
    """Fraction of the CPU(s) taken away, in (0, 0.95]; the target keeps 1 - severity."""
    pid: int | None = None
    """The target process (with all its threads and later children)."""
    job: str | None = None
    """With ``rank``: the Slurm job whose rank is the target."""
    rank: int | None = None
    """SLURM_PROCID of the target task."""
    step: str | None = None
    """The job step (needed when two steps of the job have the rank on this host)."""
    cpus: float | None = None
    """CPUs the target may use without the injection; the quota is (1 - severity) x cpus.
    None: the CPU the target actually used in the second before the injection, so that
    severity means the same on an oversubscribed node (8 ranks on 2 cores) as on an
    idle one."""

    def __post_init__(self) -> None:
        if not (0.0 < self.severity <= SEVERITY_MAX):
            raise ValueError(
                f"severity {self.severity!r} is out of range; allowed (0, {SEVERITY_MAX}] "
                "(the fraction of CPU taken away)"
            )
        if self.cpus is not None and not (0.0 < self.cpus <= 1024):
            raise ValueError(f"cpus {self.cpus!r} is out of range; allowed (0, 1024]")
        by_pid = self.pid is not None
        by_rank = self.job is not None or self.rank is not None
        if by_pid == by_rank:
            raise ValueError("give either a pid, or a job and a rank (not both, not neither)")
        if by_pid and self.step is not None:
            raise ValueError("step goes with job and rank, not with pid")
        if self.pid is not None and self.pid <= 0:
            raise ValueError(f"pid {self.pid!r} is not a process id; allowed: > 0")
        if by_rank:
            if self.job is None or self.rank is None:
                raise ValueError("a rank target needs both job and rank")
            if not re.fullmatch(r"[0-9]+", str(self.job)):
                raise ValueError(f"job {self.job!r} is not a Slurm job id; use digits, e.g. 42")
            if self.rank < 0:
                raise ValueError(f"rank {self.rank!r} is negative; allowed: >= 0")
            if self.step is not None and not re.fullmatch(r"[0-9]+", str(self.step)):
                raise ValueError(f"step {self.step!r} is not a step id; use digits, e.g. 0")

    @property
    def kind(self) -> str:
        return "compute"

    @property
    def target_keys(self) -> frozenset[tuple]:
        """Two specs sharing a key must not overlap in time."""
        if self.pid is not None:
            return frozenset({("pid", self.pid)})
        return frozenset({("rank", str(self.job), self.step, self.rank)})

    @property
    def label(self) -> str:
        return f"pid{self.pid}" if self.pid is not None else f"job{self.job}-r{self.rank}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """Throttle a link with a token bucket: an emulated node's, or one interface."""

    rate: str
    """tc rate, e.g. '200mbit' (this is the severity of a link injection)."""
    node: str | None = None
    """Emulated node 'nX': host-side gh-vethX egress and eth0 egress inside gh-nX."""
    dev: str | None = None
    """A raw interface instead of a node."""
    netns: str | None = None
    """The named network namespace (ip netns) of ``dev``; None for this namespace."""
    burst: str | None = None
    """tbf bucket size; default: max(64kb, 5 ms at the rate)."""
    latency: str = "50ms"
    """tbf queueing limit: longer waits are dropped."""

    def __post_init__(self) -> None:
        parse_rate_bps(self.rate)
        if self.burst is not None and parse_size_bytes(self.burst) < 1600:
            raise ValueError(f"burst {self.burst!r} is below one packet (1600 bytes)")
        if not (0 < parse_time_s(self.latency) <= 10):
            raise ValueError(f"latency {self.latency!r} is out of range; allowed (0, 10s]")
        if (self.node is None) == (self.dev is None):
            raise ValueError("give either a node (nX) or a dev (not both, not neither)")
        if self.node is not None:
            if self.netns is not None:
                raise ValueError("netns goes with dev; a node's namespaces are known (gh-nX)")
            node_links(self.node)
        else:
            assert self.dev is not None  # either a node or a dev (checked above)
            if not _IFNAME.match(self.dev):
                raise ValueError(f"dev {self.dev!r} is not an interface name (1-15 characters)")
            if self.netns is not None and not _NETNS.match(self.netns):
                raise ValueError(f"netns {self.netns!r} is not a namespace name")

    @property
    def kind(self) -> str:
        return "link"

    @property
    def rate_bps(self) -> float:
        return parse_rate_bps(self.rate)

    @property
    def burst_bytes(self) -> int:
        if self.burst is not None:
            return parse_size_bytes(self.burst)
        # 5 ms of traffic, at least one 64 KiB GSO super-packet (veth hands tbf packets
        # that large, and tbf drops any packet bigger than its bucket).
        return max(65536, int(self.rate_bps / 8 * 0.005))

    @property
    def links(self) -> tuple[tuple[str | None, str], ...]:
        """(netns or None, dev) of every interface whose egress is throttled."""
        if self.node is not None:
            return node_links(self.node)
        assert self.dev is not None  # either a node or a dev (__post_init__)
        return ((self.netns, self.dev),)

    @property
    def target_keys(self) -> frozenset[tuple]:
        """Two specs sharing a key (an interface) must not overlap in time."""
        return frozenset(("link", netns, dev) for netns, dev in self.links)

    @property
    def label(self) -> str:
        if self.node is not None:
            return self.node
        assert self.dev is not None  # either a node or a dev (__post_init__)
        return self.dev


Spec = ComputeSpec | LinkSpec
