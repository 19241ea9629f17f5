"""Real fail-slow injection: a CPU quota on one rank, a token bucket on one link.

Nothing here sleeps inside greyhound's own code to fake a straggler. A compute
injection moves the target's processes into a cgroup v1 cpu cgroup whose CFS quota
takes ``severity`` of a CPU away; a link injection puts a ``tbf`` qdisc on a network
interface (netem and htb are not available on these machines). Each injection is
recorded in a state directory while it is active (so ``undo-all`` can clean up after a
killed injector) and, once undone, as one JSON line of ground truth.

Modules:
    spec      what to inject (frozen dataclasses, validated)
    schedule  a YAML schedule file of specs with start offsets and durations
    targets   pids of a process or of a Slurm job step's rank
    compute   the cgroup v1 cpu quota
    link      the tbf qdisc
    state     the state directory of active injections
    truth     the ground-truth JSON-lines log
    runner    apply, wait, undo (always), concurrently for a schedule
    cli       ``greyhound inject``
"""
