"""Aviary environments (GSM8K, HotPotQA, notebook) behind NeMo Gym resources servers.

Importing this package first tells LiteLLM (imported by Aviary) to use its bundled price list
instead of fetching one over the network, then imports Aviary without LiteLLM: ``aviary.utils`` imports
LiteLLM's ``acompletion`` when it is imported (~4.5 of the ~5 CPU-seconds that importing ``aviary.core``
takes, paid by every Aviary server process at start), and calls it only to judge an answer with an
LLM. It gets a stand-in that imports LiteLLM on its first call (on a worker thread, not on the event
loop) and then calls the real one; ``import litellm`` anywhere else gets the real module.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
import types
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


async def acompletion(*args: Any, **kwargs: Any) -> Any:
    """LiteLLM's ``acompletion``, imported on first use (on a worker thread)."""
    litellm = await asyncio.to_thread(importlib.import_module, "litellm")
    return await litellm.acompletion(*args, **kwargs)


class _LiteLLMOnFirstUse(types.ModuleType):
    """What the Aviary modules imported here see as ``litellm``: ``acompletion`` above, and any other name
    from the real module, imported then."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what the import system asks (__path__, __spec__ ...): not a package
            raise AttributeError(name)
        if sys.modules.get("litellm") is self:
            del sys.modules["litellm"]
        return getattr(importlib.import_module("litellm"), name)


# The Aviary modules that import LiteLLM when they are imported (and use it only when called).
DEFERRED_IMPORTERS = ("aviary.utils", "aviary.envs.notebook.utils")


def _import_aviary_without_litellm() -> None:
    if "litellm" in sys.modules or any(name in sys.modules for name in DEFERRED_IMPORTERS):
        return
    try:
        if importlib.util.find_spec("aviary") is None or importlib.util.find_spec("litellm") is None:
            return  # nothing to defer (and a missing Aviary is reported where it is imported)
    except (ImportError, ValueError):
        return
    stand_in = _LiteLLMOnFirstUse("litellm")
    stand_in.acompletion = acompletion  # type: ignore[attr-defined]
    sys.modules["litellm"] = stand_in
    try:
        for name in DEFERRED_IMPORTERS:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # not in this Aviary version (or not installed): imported as usual where needed
    finally:
        if sys.modules.get("litellm") is stand_in:
            del sys.modules["litellm"]


_import_aviary_without_litellm()
