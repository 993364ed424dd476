"""Benchmarks, one module per thing measured; each reports ratios measured in one run.

:mod:`~nemo_gym.tools.bench.stack` (``ng_bench``: a whole stack against the bare one of
:mod:`~nemo_gym.tools.bench.bare`), :mod:`~nemo_gym.tools.bench.collector` (``ng_bench +suite=collector``:
the collector's peak RSS and CPU per rollout at scale, against a minimal agent), :mod:`~nemo_gym.tools.bench.ray` and its server
:mod:`~nemo_gym.tools.bench.ray_server` (replicas on Ray), :mod:`~nemo_gym.tools.bench.sandbox`
(``ng_bench_sandbox``), :mod:`~nemo_gym.tools.bench.viewer` (the viewer's index and pages) and
:mod:`~nemo_gym.tools.bench.startup` (``ng_run``'s time to "servers ready", per phase, and its memory).
"""
