"""The ``tracing`` switch of a run: which value turns OpenTelemetry traces on, and what it needs.

Contract
--------
* ``+tracing=otlp`` (top-level) turns traces on: every server exports its spans over OTLP/HTTP to
  ``tracing_endpoint`` (default :data:`DEFAULT_TRACING_ENDPOINT`). Unset, ``false``, ``none`` or ``off``:
  traces are off, and nothing of OpenTelemetry is imported anywhere (the server and client sides are
  :mod:`nemo_gym.server.tracing` and :mod:`nemo_gym.client.tracing`).
* :func:`tracing_mode` reads the switch (``ValueError`` for any other value); :func:`tracing_problems`
  is the launcher's check before anything starts: a bad value, a bad endpoint, or ``otlp`` without the
  OpenTelemetry packages (the ``tracing`` extra) installed. Looking for the packages imports none of
  them (only the ``opentelemetry`` namespace package, when tracing is on).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from nemo_gym.config.flags import OFF_WORDS

TRACING_KEY_NAME = "tracing"
TRACING_ENDPOINT_KEY_NAME = "tracing_endpoint"
DEFAULT_TRACING_ENDPOINT = "http://127.0.0.1:4318/v1/traces"
OTLP = "otlp"
TRACING_MODES = (OTLP,)
# The modules ``+tracing=otlp`` imports (from the packages of the ``tracing`` extra).
REQUIRED_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
MISSING_PACKAGES_HINT = (
    "+tracing=otlp needs the OpenTelemetry packages (opentelemetry-api, opentelemetry-sdk, "
    "opentelemetry-exporter-otlp-proto-http): pip install 'nemo-gym[tracing]'"
)


def tracing_mode(global_config: Mapping[str, Any] | Any | None) -> str | None:
    """``"otlp"`` when the run's config turns traces on, else None; ``ValueError`` for an unknown value."""
    if global_config is None:
        return None
    try:
        value = global_config.get(TRACING_KEY_NAME)
    except Exception:  # not a mapping: nothing set
        return None
    if value is None or value is False:
        return None
    text = str(value).strip().lower()
    if text in OFF_WORDS:
        return None
    if text in TRACING_MODES:
        return text
    raise ValueError(f"must be one of {', '.join(TRACING_MODES)} (or false for no traces), got {value!r}")


def tracing_endpoint(global_config: Mapping[str, Any] | Any | None) -> str:
    """The OTLP/HTTP endpoint spans are sent to (the run's ``tracing_endpoint``, else the default)."""
    value = global_config.get(TRACING_ENDPOINT_KEY_NAME) if global_config is not None else None
    return str(value) if value else DEFAULT_TRACING_ENDPOINT


def missing_tracing_modules() -> list[str]:
    """The modules ``+tracing=otlp`` needs that cannot be imported here (none are imported)."""
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def tracing_problems(global_config: Mapping[str, Any] | Any) -> list[tuple[str, str]]:
    """``(key, what is wrong)`` for the run's tracing settings (empty: nothing, or traces off)."""
    try:
        mode = tracing_mode(global_config)
    except ValueError as e:
        return [(TRACING_KEY_NAME, str(e))]
    if mode is None:
        return []
    problems = []
    endpoint = tracing_endpoint(global_config)
    if not endpoint.startswith(("http://", "https://")):
        problems.append(
            (
                TRACING_ENDPOINT_KEY_NAME,
                f"must be an http:// or https:// URL (an OTLP/HTTP traces endpoint such as "
                f"{DEFAULT_TRACING_ENDPOINT}), got {endpoint!r}",
            )
        )
    missing = missing_tracing_modules()
    if missing:
        problems.append((TRACING_KEY_NAME, f"{MISSING_PACKAGES_HINT} (missing: {', '.join(missing)})"))
    return problems
