"""Upstream NeMo Gym's module path ``nemo_gym.testing.session_conformance`` (0.7), kept as a thin face of
:mod:`nemo_gym.tools.session_conformance`."""

from nemo_gym.tools.session_conformance import check_resources_session_contract

__all__ = ["check_resources_session_contract"]
