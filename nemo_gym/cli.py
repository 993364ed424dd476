"""Upstream NeMo Gym's module path ``nemo_gym.cli``, kept as a thin face for trainer scripts.

NeMo RL and other trainers write ``from nemo_gym.cli import GlobalConfigDictParserConfig, RunHelper``;
those are upstream's public names here that we implement. The ``ng_*`` commands and ``RunHelper``
live in :mod:`nemo_gym.run.cli`; our own code imports from there.
"""

from __future__ import annotations

from nemo_gym.config.parser import GlobalConfigDictParserConfig
from nemo_gym.run.cli import RunHelper

__all__ = ["GlobalConfigDictParserConfig", "RunHelper"]
