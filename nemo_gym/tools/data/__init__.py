"""Dataset tooling: ``ng_prepare_data`` (:mod:`nemo_gym.tools.data.prepare`) and its metrics (:mod:`nemo_gym.tools.data.metrics`)."""
