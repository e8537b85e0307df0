"""Trainer-side integrations: a scoring hook for any async rollout loop (`rollout`), verl's
teacher-client interface served by proctor (`verl`), and the CPU demo (`demo`).

Imports `proctor.client` only; verl is imported inside the functions that need it.
"""

from proctor.trainer_adapter.rollout import RolloutSample, RolloutScorer, RoutingError, ScoredSample

__all__ = ["RolloutSample", "RolloutScorer", "RoutingError", "ScoredSample"]
