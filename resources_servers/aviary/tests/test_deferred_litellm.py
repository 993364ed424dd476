"""Aviary imported without LiteLLM (resources_servers/aviary/__init__.py), and LiteLLM there on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import asyncio, sys
import resources_servers.aviary.app, resources_servers.aviary.gsm8k_app, resources_servers.aviary.notebook_app
import resources_servers.data_analysis_capsules.app
import aviary.utils, aviary.envs.notebook.utils as notebook_utils
print("loaded at start:", "litellm" in sys.modules)
# Aviary's LLM answer judge: the real acompletion, imported on this first call (LiteLLM's offline mock).
reply = asyncio.run(aviary.utils.acompletion(
    model="openai/judge", messages=[{"role": "user", "content": "2+2?"}], mock_response="4"))
print("answer:", reply.choices[0].message.content)
import litellm
print("real module:", type(litellm).__name__, litellm.acompletion.__module__.startswith("litellm."))
print("notebook sees it:", notebook_utils.litellm.completion is litellm.completion)
"""


def test_aviary_servers_start_without_litellm_and_get_it_on_first_use() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "loaded at start: False",
        "answer: 4",
        "real module: module True",
        "notebook sees it: True",
    ], done.stdout + done.stderr
