"""Tools: the commands a person runs around a run, on top of every other wing.

The rollout viewer (:mod:`~nemo_gym.tools.viewer`, ``ng_viewer``), benchmarks (:mod:`~nemo_gym.tools.bench`,
``ng_bench*``), re-verification and export of collected rollouts (:mod:`~nemo_gym.tools.reverify`,
:mod:`~nemo_gym.tools.export_transitions`), the adversarial audit of environments' rewards
(:mod:`~nemo_gym.tools.reward_audit`, ``ng_reward_audit``), the eval workflow (:mod:`~nemo_gym.tools.eval`,
``ng_e2e_collect_rollouts``), data preparation (:mod:`~nemo_gym.tools.data`), scaffolding a new
environment (:mod:`~nemo_gym.tools.scaffold`), listing the servers found (:mod:`~nemo_gym.tools.server_list`,
``ng_list``), running an environment's own tests (:mod:`~nemo_gym.tools.server_tests`, ``ng_test``) and
upstream's (:mod:`~nemo_gym.tools.upstream_check`), the quick start (:mod:`~nemo_gym.tools.quickstart`),
plots of a run's series read back from Prometheus (:mod:`~nemo_gym.tools.metrics_plots`),
the test harness for environment authors (:mod:`~nemo_gym.tools.testing`) and its pytest plugin
(:mod:`~nemo_gym.tools.pytest_plugin`).

May import: every wing. Nothing outside ``tools`` imports it.
"""
