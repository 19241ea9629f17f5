"""Which node-to-node links the job uses, and in how few passes they can all be tested.

A P2P bandwidth test of one link must not share its nodes with another test running at
the same time, or each measures half a NIC. The links are the edges of a graph on the
nodes; a *pass* is a set of edges with no node in common (a matching), and the fewest
passes are an edge colouring. Communication patterns give: a ring of even size, 2
passes; an odd ring, 3; a tree, at most 4 (greedy colouring in breadth-first order uses
at most max-degree colours on a tree; a binary tree's inner nodes have degree 3). The
colouring here is greedy over edges in the order given, which the callers make the
order of each ring, and it is checked against those bounds in the tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def job_links(groups: Iterable[Sequence[str]]) -> list[tuple[str, str]]:
    """The distinct node pairs the job's communicators connect, in ring order.

    Args:
        groups: for each communicator, the nodes of its members in rank order (a p2p
            pair gives one link, a collective the links of a ring through its nodes).
    Returns:
        Pairs (a, b) with a != b, each once (either direction), in first-seen order.
    """
    seen: set[frozenset] = set()
    out: list[tuple[str, str]] = []
    for nodes in groups:
        ring = list(dict.fromkeys(nodes))          # distinct nodes, order kept
        if len(ring) < 2:
            continue
        edges = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
        if len(ring) == 2:
            edges = edges[:1]
        for a, b in edges:
            key = frozenset((a, b))
            if key not in seen:
                seen.add(key)
                out.append((a, b))
    return out


def link_passes(links: Sequence[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Links split into passes of node-disjoint links (a greedy edge colouring)."""
    passes: list[list[tuple[str, str]]] = []
    busy: list[set[str]] = []
    for a, b in links:
        for i, used in enumerate(busy):
            if a not in used and b not in used:
                passes[i].append((a, b))
                used.update((a, b))
                break
        else:
            passes.append([(a, b)])
            busy.append({a, b})
    return passes
