"""Upstream NeMo Gym's module path ``nemo_gym.episode_types`` (0.7), kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.episodes`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.server.episodes import (
    BaseEpisodeRequest,
    BaseEpisodeResponse,
    EpisodeFailure,
    EpisodeId,
    EpisodeResultT,
    MaterializedTask,
    TaskId,
    TaskInputT,
    is_materialized_task_row,
)

__all__ = [
    "BaseEpisodeRequest",
    "BaseEpisodeResponse",
    "EpisodeFailure",
    "EpisodeId",
    "EpisodeResultT",
    "MaterializedTask",
    "TaskId",
    "TaskInputT",
    "is_materialized_task_row",
]
