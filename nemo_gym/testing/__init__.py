"""Upstream NeMo Gym's package ``nemo_gym.testing`` (0.7): thin faces of helpers a server's own tests import
(``session_conformance``). Our test helpers are in :mod:`nemo_gym.tools`."""
