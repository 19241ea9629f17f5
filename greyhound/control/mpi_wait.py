"""Waiting on the control plane's MPI world without spinning.

Open MPI's blocking calls poll the transport in a busy loop. A plane rank waiting in
one (for a GEMM that runs in another node's training process, or for the other pair of
a P2P pass) holds a core all along: on nodes that share cores with the job (or
emulated nodes sharing a machine) that halved the GEMM of a healthy rank and cut a
healthy link's measured bandwidth to 7% of the others', and validation named the
wrong fault. Here a wait is a non-blocking request tested ever less often, sleeping
in between.
"""

from __future__ import annotations

import time


def wait(request, *, beat=lambda: None, stopped=lambda: False, max_nap_s: float = 0.05) -> bool:
    """Waits for a non-blocking MPI request, testing it ever less often (1 ms, 2 ms, ...,
    ``max_nap_s``): each test drives Open MPI's TCP transport, and testing every 2 ms
    kept each waiting plane rank at a tenth of a core. ``beat`` runs between tests.
    False when ``stopped()`` says to give up."""
    nap = 0.001
    while not request.Test():
        if stopped():
            return False
        beat()
        time.sleep(nap)
        nap = min(2 * nap, max_nap_s)
    return True


VALIDATION_NAP_S = 0.005
"""The longest nap between tests during a validation round: every wait there lengthens
the job's pause, so it is kept short (a sleeping rank costs no CPU either way)."""


def barrier(comm, *, beat=lambda: None) -> None:
    """``comm.Barrier()`` without spinning."""
    wait(comm.Ibarrier(), beat=beat, max_nap_s=VALIDATION_NAP_S)


def allgather(comm, value, *, beat=lambda: None) -> list:
    """``comm.allgather(value)`` without spinning while the slowest rank gets there:
    a barrier that sleeps, then the exchange itself (every rank is there: milliseconds)."""
    barrier(comm, beat=beat)
    return comm.allgather(value)
