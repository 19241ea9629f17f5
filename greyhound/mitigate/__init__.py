"""GREYHOUND-MITIGATE: the actions of the ski-rental ladder, and the ladder itself.

The package holds the S2 solver (re-split a step's micro-batches across DP groups),
S3 placement (swap DP/PP roles off a slow link; gather compute stragglers into the
fewest DP replicas, so that S2 can unload them), S4 requeue (checkpoint and requeue
without the bad node), and the ladder that escalates from one to the next as the loss
of a fail-slow adds up (DESIGN.md, "Mitigation").

Modules:
    microbatch  the S2 solver: integer micro-batch counts that minimise the slowest
                DP group's time, exactly (pure, numpy in, a small dataclass out)
    placement   S3's exact placement search on a step-time model (links, stages)
    gather      S3 for compute stragglers: DP-rank exchanges within stages that put
                them into the fewest replicas, scored by S2's optimum
    cli         ``greyhound plan``
"""
