"""Benchmark folders, importable as ``benchmarks.<name>`` (NVIDIA NeMo Gym's top-level ``benchmarks`` package).

Contract
--------
* A benchmark lives in ``benchmarks/<name>/``: its ``config.yaml`` (an agent instance whose dataset has
  ``type: benchmark``), the ``prepare.py`` that builds its JSONL, small ``data/`` and a README. Upstream
  environments import helpers from their benchmark folder (``from benchmarks.<name> import prepare``,
  ``from benchmarks.<name>.materialize import ...``); with the folder copied here, those imports work
  unchanged, whether the folder has an ``__init__.py`` or not.
* The package is found from the repository root (on ``sys.path`` for the servers ``ng_run`` starts and,
  through the root ``conftest.py``, for every test run) and is installed alongside ``nemo_gym``.
* Nothing is imported here: a benchmark folder's modules load only when something imports them.
"""
