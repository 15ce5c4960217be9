"""Parameter groups of the kernels, with the paper's defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeatParams:
    """Heat = alpha * N_visit + beta * L_interaction + gamma * exp(-dt / mu); promote at >= tau.

    Defaults are the paper's (alpha = beta = gamma = 1, mu = 1e7 s, tau = 5). ``evict_by_visits``
    switches eviction from lowest heat (paper) to lowest N_visit (LFU, the reference code).
    """

    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 1.0
    mu: float = 1e7
    tau: float = 5.0
    evict_by_visits: bool = False

    def __post_init__(self) -> None:
        if not self.mu > 0:
            raise ValueError(f"HeatParams.mu must be > 0 seconds, got {self.mu}")
