"""P2P bandwidth tests between the job's nodes, run by the node agents with mpi4py.

Collective over the control plane's world (one rank per node): every agent calls
:func:`measure_passes` with the same passes; in each pass the two agents of a link
exchange ``nbytes`` both ways (``Sendrecv``) ``repeats`` times, the others wait at the
pass's barrier. Each link's bandwidth is bytes moved each way / the fastest repeat's
seconds: what the link can do (a throttled link is slow every time; other work on a
shared node slows some repeats, not all). :func:`slow_links` then judges links against the others (pure).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from greyhound.control import mpi_wait

LINK_SEPARATOR = "<->"
"""Between a link's two node names ("n3<->n4"): node names carry hyphens
("gpu-a100-01"), never "<" or ">"."""


def link_name(a: str, b: str) -> str:
    return f"{a}{LINK_SEPARATOR}{b}"


def link_ends(name: str) -> tuple[str, str]:
    """The two nodes of a link named by :func:`link_name`."""
    a, b = name.split(LINK_SEPARATOR)
    return a, b


SLOW_FRACTION = 0.3
"""A link below 30% of the median bandwidth of the job's links is slow (loopback links of
emulated nodes on a busy 2-core machine measured down to 42% with nothing wrong; a link
narrowed to 20 Mbit/s measures about 1%)."""


def measure_passes(comm, node: str, passes: Sequence[Sequence[tuple[str, str]]], *,
                   nodes: Sequence[str], nbytes: int = 1 << 20, repeats: int = 3) -> dict[str, float]:
    """Bandwidth (bytes/s) of each link this agent took part in, keyed by :func:`link_name`.

    Args:
        comm: the control plane's MPI communicator (rank i runs on nodes[i]).
        node: this agent's node.
        passes: node-disjoint links per pass (links.link_passes), the same on every rank.
        nodes: node of each rank of comm.
        nbytes: bytes each way per repeat: 1 MiB takes milliseconds on a healthy link
            and about 0.4 s on a 20 Mbit/s one, which keeps the pause short either way.
    """
    rank_of = {n: i for i, n in enumerate(nodes)}
    send = np.ones(nbytes, dtype=np.uint8)
    recv = np.empty_like(send)
    out: dict[str, float] = {}
    for links in passes:
        for a, b in links:
            if node not in (a, b):
                continue
            peer = rank_of[b if node == a else a]
            out[link_name(a, b)] = nbytes / _fastest_exchange(comm, peer, send, recv, repeats)
        mpi_wait.barrier(comm)     # the agents of the other links sleep meanwhile
    return out


SLOW_REPEAT_S = 0.2
"""An exchange this long has measured its link (1 MiB at 5 MB/s: a few percent of a
healthy link); repeating it would only hold the job's pause (a link narrowed to
20 Mbit/s held it 18 s with three repeats of every pass)."""


def _fastest_exchange(comm, peer: int, send: np.ndarray, recv: np.ndarray, repeats: int) -> float:
    """Seconds of the fastest of up to ``repeats`` exchanges with ``peer``. After each,
    the two ends swap their times and both stop once the slower took SLOW_REPEAT_S: the
    same decision on both sides, or one would wait for ever for the other's next send."""
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        comm.Sendrecv(send, dest=peer, sendtag=7, recvbuf=recv, source=peer, recvtag=7)
        took = time.perf_counter() - t0
        best = min(best, took)
        if i + 1 < repeats:
            mine, theirs = np.array([took]), np.empty(1)
            comm.Sendrecv(mine, dest=peer, sendtag=8, recvbuf=theirs, source=peer, recvtag=8)
            if max(took, float(theirs[0])) >= SLOW_REPEAT_S:
                break
    return best


def slow_links(bandwidth: dict[str, float], *, fraction: float = SLOW_FRACTION) -> list[dict]:
    """Links below ``fraction`` of the median bandwidth, slowest first, with the node
    they share with other slow links (the node whose NIC or link is at fault) if any."""
    if len(bandwidth) < 2:
        return []
    median = float(np.median(list(bandwidth.values())))
    slow = sorted((bw, link) for link, bw in bandwidth.items() if bw < fraction * median)
    counts: dict[str, int] = {}
    for _, link in slow:
        for n in link_ends(link):
            counts[n] = counts.get(n, 0) + 1
    out = []
    for bw, link in slow:
        a, b = link_ends(link)
        common = a if counts[a] > counts[b] else b if counts[b] > counts[a] else None
        out.append({"link": link, "bandwidth_Bps": bw, "ratio": bw / median, "node": common})
    return out
