"""Aviary environments (GSM8K, HotPotQA, notebook) behind NeMo Gym resources servers.

Importing this package first tells LiteLLM (imported by Aviary) to use its bundled price list
instead of fetching one over the network.
"""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
