"""Rollout collection, one module per concept (the collector behind ``ng_collect_rollouts``).

Contract
--------
* :mod:`nemo_gym.rollout_collection` stays upstream's path, a thin face with upstream's names
  (``RolloutCollectionHelper``, ``RolloutCollectionConfig``, ...), and its docstring states the
  collector's whole contract. Our own code imports from the modules here.
* Modules, from the bottom up: :mod:`.options` (the options and :class:`InputError`),
  :mod:`.input_rows` (streaming validation and materialisation of the input), :mod:`.row_schema` (rows
  against the environment's ``GET /row_schema``), :mod:`.output_files` (sidecar paths, whole-line
  writer, resume scans), :mod:`.circuit_breaker` (failure classification and the replica-aware
  breaker), :mod:`.dispatch` (``/run`` calls and :func:`~.dispatch.bounded_map`), :mod:`.live_stats`
  (running counts, the progress postfix, ``+metrics_port``'s ``GET /metrics``), :mod:`.summary` (the
  typed end-of-run summary), :mod:`.collector` (the whole job: plan, run, report), :mod:`.helper` (the trainers' Python API) and
  :mod:`.cli` (``ng_collect_rollouts``). Each imports only modules listed before it; none imports
  :mod:`nemo_gym.rollout_collection`.
* Importing this package imports none of its modules (and nothing heavy).
"""
