"""The global configuration's machinery, one module per concept.

``nemo_gym.config.process`` is the public face (upstream NeMo Gym's module path): it re-exports every
name below and holds this process's config. Import from there; the modules here are where the code
lives:

* :mod:`~nemo_gym.config.keys`: key names, environment variable names and defaults.
* :mod:`~nemo_gym.config.problems`: :class:`ConfigError`, where each key was set, how problems are worded.
* :mod:`~nemo_gym.config.overrides`: Hydra-syntax command-line overrides.
* :mod:`~nemo_gym.config.loading`: YAML files, env.yaml and overrides merged into one config.
* :mod:`~nemo_gym.config.instances`: the server instances a config defines.
* :mod:`~nemo_gym.config.options`: the registry of each command's options and the typo check.
* :mod:`~nemo_gym.config.missing`: values that are not set or cannot be resolved.
* :mod:`~nemo_gym.config.network`: port range, client connection limits, a free port.
* :mod:`~nemo_gym.config.validation`: the one check of a whole config before anything starts.
* :mod:`~nemo_gym.config.parser`: upstream's ``GlobalConfigDictParser`` and its settings.
"""
