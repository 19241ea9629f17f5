"""Types of the compiled BOCD+V kernel (_bocdv.c); verify.CompiledBocdV is its only user."""

from collections.abc import Callable
from typing import Any

import numpy as np

class Kernel:
    """BOCD+V's state; the constants come from bocd.derived_constants and the configs."""

    def __init__(
        self, *, log_h: float, log_1mh: float, log_eps: float, log_1m_eps: float,
        logpred0_base: float, prune_factor: float, kappa_first: float, alpha_first: float,
        mad_per_sigma: float, alpha0: float, noise_default: float, noise_floor: float,
        clip: float, threshold: float, max_hypotheses: int, noise_window: int,
        noise_min_samples: int, min_change: float, keep_prob: float, min_after: int,
        max_pending: int, before_window: int, creep_window: int, creep_every: int,
        hold_newest: int, min_before: int, max_visited: float, values_capacity: int,
        lg_table: Callable[..., Any], exact_math: bool = False,
    ) -> None: ...
    def feed(self, xs: np.ndarray, /) -> list[tuple[int, int, float, float]]:
        """(index, detected_at, before, after) of each change point accepted."""
    def update(self, x: float, /) -> tuple[int, int, float, float] | None: ...
    def posterior(self) -> tuple[int, list[int], list[float], float]:
        """(t, starts, probs, noise_scale)."""
    @property
    def pending(self) -> int | None: ...
    @property
    def count(self) -> int: ...
    @property
    def math(self) -> str: ...
