"""Upstream NeMo Gym's module path ``nemo_gym.prompt``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.kit.prompt`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.kit.prompt import (
    MaterializePromptsConfig,
    PromptConfig,
    apply_prompt_to_row,
    fill_prompt,
    load_prompt_config,
    materialize_prompts,
    validate_prompt_compatibility,
)

__all__ = [
    "MaterializePromptsConfig",
    "PromptConfig",
    "apply_prompt_to_row",
    "fill_prompt",
    "load_prompt_config",
    "materialize_prompts",
    "validate_prompt_compatibility",
]
