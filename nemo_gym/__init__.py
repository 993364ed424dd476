"""NeMo Gym (independent implementation): RL environments for LLM agents, and verified rollouts.

The pieces (see docs/concepts.md): model servers, resources servers and agents, each a FastAPI
process, started by ``ng_run`` and talking over HTTP with per-rollout session cookies.

The package is in wings by role, each importing only the wings before it in this list (checked by
tests/test_architecture.py; each wing's ``__init__`` says what it is for):

* base modules: ``errors`` (error answers and upstream errors), ``redaction`` (secrets kept out of
  output), ``jsonl``, ``auth`` (the run token), ``launch`` (what ng_run hands a server privately);
* ``config/`` (loading, validating and holding a config);
* ``openai_utils/`` (the OpenAI API types, at upstream's path);
* ``kit/`` (the environment author's helpers; ``sandbox/`` at upstream's path beside it);
* ``client/`` (talking to the servers of a run);
* ``server/`` (what runs inside every server: the base classes, the ASGI layer, sessions);
* ``environment_servers/`` (server folders that ship with the package: NeMo Gym 0.7's generic
  environment servers, found by ``ng_run`` from any directory);
* ``run/`` (``ng_run``: start and supervise the servers);
* ``collection/`` (``ng_collect_rollouts``);
* ``tools/`` (viewer, benchmarks, eval, scaffolding and the other commands around a run).

The other top-level modules are upstream NeMo Gym's paths kept as thin faces for code written against
upstream (``server_utils``, ``base_resources_server``, ``base_responses_api_agent``,
``base_responses_api_model``, ``base_environment_server``, ``episode_types``, ``config_types``,
``global_config``, ``judge``, ``prompt``,
``reward_profile``, ``responses_converter``, ``rollout_correlation``, ``mcp_auto_exposure``,
``rollout_collection``, ``path_utils``, ``cli``, ``verifier_fixture``, and the package ``testing``): each
holds exactly upstream's public names that we
implement, imported from the module that defines them. Code in this package imports every name from
its defining module, never through a face; environment folders use upstream's paths for upstream's
names, so they run on either implementation.

Path constants upstream NeMo Gym code imports from the package root (importing them has no side
effect): ``ROOT_DIR`` (this package's folder), ``PARENT_DIR`` (its parent: the repository root in a
checkout), ``WORKING_DIR`` (``PARENT_DIR`` when it holds a ``pyproject.toml``, i.e. a checkout or an
editable install, else the current directory at import), ``CACHE_DIR`` and ``RESULTS_DIR`` (under
``WORKING_DIR``; not created here).
"""

from pathlib import Path

__version__ = "0.1.0"

ROOT_DIR: Path = Path(__file__).resolve().parent
PARENT_DIR: Path = ROOT_DIR.parent
WORKING_DIR: Path = PARENT_DIR if (PARENT_DIR / "pyproject.toml").is_file() else Path.cwd()
CACHE_DIR: Path = WORKING_DIR / "cache"
RESULTS_DIR: Path = WORKING_DIR / "results"
