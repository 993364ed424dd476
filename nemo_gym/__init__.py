"""NeMo Gym (independent implementation): RL environments for LLM agents, and verified rollouts.

The pieces (see docs/concepts.md): model servers, resources servers and agents, each a FastAPI
process, started by ``ng_run`` and talking over HTTP with per-rollout session cookies.
"""

__version__ = "0.1.0"
