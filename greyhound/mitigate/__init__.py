"""GREYHOUND-MITIGATE: the actions of the ski-rental ladder, and the ladder itself.

The package holds the S2 solver (re-split a step's micro-batches across DP groups),
S3 placement (swap DP/PP roles, consolidate stragglers into inner PP stages), S4
requeue (checkpoint and requeue without the bad node), and the ladder that escalates
from one to the next as the loss of a fail-slow adds up (DESIGN.md, "Mitigation").

Modules:
    microbatch  the S2 solver: integer micro-batch counts that minimise the slowest
                DP group's time, exactly (pure, numpy in, a small dataclass out)
    cli         ``greyhound plan``
"""
