"""Communication fail-slow: a tbf qdisc narrows the egress of one or two interfaces.

``tc qdisc replace dev IF root tbf rate R burst B latency L`` (``tc -n NS`` inside a
named namespace). For an emulated node nX both directions of its link are throttled:
the host-side veth gh-vethX shapes what the bridge sends to the node, eth0 inside gh-nX
what the node sends. Undo deletes the root qdisc, which gives the interface back its
default qdisc.

An interface that already has a non-default root qdisc is refused: replacing it would
destroy someone else's shaping, and deleting ours would not bring it back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from greyhound.errors import InputError
from greyhound.inject.spec import LinkSpec

log = logging.getLogger(__name__)

NETNS_DIR = Path("/var/run/netns")
DEFAULT_QDISCS = frozenset({"noqueue", "pfifo_fast", "mq", "fq_codel", "fq", "pfifo", "bfifo"})
_TIMEOUT_S = 10


def _tc(netns: str | None, *args: str) -> subprocess.CompletedProcess:
    argv = ["tc"] + (["-n", netns] if netns else []) + list(args)
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"{' '.join(argv)}: {exc}") from exc


def _where(netns: str | None, dev: str) -> str:
    return f"{dev} in netns {netns}" if netns else dev


def root_qdisc(netns: str | None, dev: str) -> str | None:
    """Kind of the root qdisc of dev ('noqueue', 'tbf', ...); None if dev is gone."""
    proc = _tc(netns, "-j", "qdisc", "show", "dev", dev, "root")
    if proc.returncode != 0:
        return None
    try:
        qdiscs = json.loads(proc.stdout or "[]")
    except ValueError:
        return None
    return qdiscs[0].get("kind") if qdiscs else "noqueue"


def check_link(netns: str | None, dev: str) -> None:
    """InputError unless dev exists (in netns) and has no foreign root qdisc."""
    if netns is not None and not (NETNS_DIR / netns).exists():
        raise InputError(f"network namespace {netns!r} does not exist (ip netns list shows them)")
    proc = subprocess.run(["ip"] + (["-n", netns] if netns else []) + ["link", "show", "dev", dev],
                          capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise InputError(f"interface {_where(netns, dev)} does not exist")
    kind = root_qdisc(netns, dev)
    if kind == "tbf":
        raise InputError(f"{_where(netns, dev)} is already throttled (root qdisc tbf); "
                         "wait for that injection to end or run `greyhound inject undo-all`")
    if kind not in DEFAULT_QDISCS:
        raise InputError(f"{_where(netns, dev)} has root qdisc {kind!r}; refusing to replace it "
                         f"(allowed: one of {', '.join(sorted(DEFAULT_QDISCS))})")


def check_environment() -> None:
    if os.geteuid() != 0:
        raise InputError("link injection needs root (it changes qdiscs)")
    for tool in ("tc", "ip"):
        if shutil.which(tool) is None:
            raise InputError(f"link injection needs `{tool}` (Debian package iproute2)")


def remove_tbf(netns: str | None, dev: str) -> bool:
    """Delete dev's root qdisc if it is a tbf; True if one was removed."""
    if root_qdisc(netns, dev) != "tbf":
        return False
    proc = _tc(netns, "qdisc", "del", "dev", dev, "root")
    if proc.returncode != 0 and root_qdisc(netns, dev) == "tbf":
        raise InputError(f"cannot remove the tbf qdisc of {_where(netns, dev)}: "
                         f"{proc.stderr.strip() or proc.returncode}")
    return True


class LinkInjection:
    """One link injection; apply() then undo() (undo is safe after a partial apply)."""

    kind = "link"

    def __init__(self, spec: LinkSpec, *, injection_id: str) -> None:
        self.spec = spec
        self.id = injection_id
        self.links: list[tuple[str | None, str]] = []
        """Interfaces whose qdisc we replaced (or were about to), in order."""

    def preflight(self) -> None:
        check_environment()
        for netns, dev in self.spec.links:
            try:
                check_link(netns, dev)
            except InputError as exc:
                if self.spec.node is None:
                    raise
                raise InputError(f"node {self.spec.node}: {exc} (emulated nodes have their links "
                                 "when the cluster runs with `scripts/cluster up --netns`)") from exc

    def resolve(self) -> None:
        self.preflight()  # the link may have changed since the schedule was checked

    def state(self) -> dict:
        return {"kind": self.kind, "links": [{"netns": n, "dev": d} for n, d in self.links]}

    def apply(self, record_state=lambda: None) -> None:
        spec = self.spec
        for netns, dev in spec.links:
            self.links.append((netns, dev))
            record_state()  # before the change, so undo-all knows it even if we die now
            proc = _tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                       "rate", spec.rate, "burst", str(spec.burst_bytes), "latency", spec.latency)
            if proc.returncode != 0:
                raise InputError(f"tc could not throttle {_where(netns, dev)} to {spec.rate}: "
                                 f"{proc.stderr.strip() or proc.returncode}")
            log.info("%s: %s throttled to %s", self.id, _where(netns, dev), spec.rate)

    def target_alive(self) -> bool:
        return True

    def undo(self) -> None:
        errors = []
        for netns, dev in reversed(self.links):
            try:
                if remove_tbf(netns, dev):
                    log.info("%s: %s unthrottled", self.id, _where(netns, dev))
            except InputError as exc:
                errors.append(str(exc))
        if errors:
            raise InputError("; ".join(errors))

    def truth_fields(self) -> dict:
        return {"severity": self.spec.rate, "rate_bps": self.spec.rate_bps, "node": self.spec.node,
                "links": [{"netns": n, "dev": d} for n, d in self.links]}
