"""Upstream NeMo Gym's module path ``nemo_gym.verifier_fixture`` (0.7), kept as a thin face: the names are
defined, and the fixture format written out, in :mod:`nemo_gym.tools.verifier_fixture`."""

from nemo_gym.tools.verifier_fixture import (
    VerifierFixture,
    VerifierFixtureCase,
    VerifierFixtureError,
    VerifierFixtureResult,
    exercise_verifier_fixture,
    load_verifier_fixture,
)

__all__ = [
    "VerifierFixture",
    "VerifierFixtureCase",
    "VerifierFixtureError",
    "VerifierFixtureResult",
    "exercise_verifier_fixture",
    "load_verifier_fixture",
]
