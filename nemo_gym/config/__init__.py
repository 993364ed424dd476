"""The global configuration's machinery, one module per concept.

The modules here are where the code lives; ``nemo_gym.global_config`` and ``nemo_gym.config_types``
are upstream NeMo Gym's paths, thin faces holding upstream's names for code written against upstream.
Our own code imports from these modules:

* :mod:`~nemo_gym.config.process`: the config THIS process holds (``get_global_config_dict``, ...).
* :mod:`~nemo_gym.config.types`: the server config classes (``BaseServerConfig``, dataset configs, ...).
* :mod:`~nemo_gym.config.ports`: reserving a listening socket, choosing free ports.
* :mod:`~nemo_gym.config.command`: how every ``ng_*`` command starts and ends (``@command``).
* :mod:`~nemo_gym.config.discovery`: server folders and installed environment packages.

* :mod:`~nemo_gym.config.keys`: key names, environment variable names and defaults.
* :mod:`~nemo_gym.config.problems`: :class:`ConfigError`, where each key was set, how problems are worded.
* :mod:`~nemo_gym.config.overrides`: Hydra-syntax command-line overrides.
* :mod:`~nemo_gym.config.loading`: YAML files, env.yaml and overrides merged into one config.
* :mod:`~nemo_gym.config.instances`: the server instances a config defines.
* :mod:`~nemo_gym.config.options`: the registry of each command's options and the typo check.
* :mod:`~nemo_gym.config.missing`: values that are not set or cannot be resolved.
* :mod:`~nemo_gym.config.network`: port range, client connection limits, a free port.
* :mod:`~nemo_gym.config.tracing`: the ``+tracing=otlp`` switch and what it needs.
* :mod:`~nemo_gym.config.validation`: the one check of a whole config before anything starts.
* :mod:`~nemo_gym.config.parser`: upstream's ``GlobalConfigDictParser`` and its settings.
"""
