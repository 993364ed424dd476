"""nemo_gym.kit.pyast: ast.parse from many threads at once, as a verifier on worker threads does."""

from __future__ import annotations

import ast
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nemo_gym.kit import pyast

SOURCE = "\n".join(
    f"def f{i}(a, b):\n    return [(a + b * {i}) for _ in range(3)] if a else {{'k': (b, a, {i})}}"
    for i in range(200)
)
HAS_CPYTHON_BUG = sys.implementation.name == "cpython" and sys.version_info < (3, 12, 4)  # gh-106905


@pytest.fixture
def switching_gc() -> Iterator[None]:
    """Frequent collections that give up the GIL: a thread switch in the middle of a parse."""
    threshold = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    gc.callbacks.append(lambda phase, info: time.sleep(0))
    try:
        yield
    finally:
        gc.callbacks.pop()
        gc.set_threshold(*threshold)


def _errors_parsing_in_threads(parse: Callable[[str], Any], seconds: float = 2.0) -> list[str]:
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def worker() -> None:
        while time.monotonic() < stop and not errors:
            try:
                assert len(parse(SOURCE).body) == 200
            except SystemError as e:
                errors.append(str(e))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return errors


def test_parses_from_eight_threads_never_collide(switching_gc: None) -> None:
    if HAS_CPYTHON_BUG:  # the conditions reproduce the interpreter's bug with the bare call...
        assert any("recursion depth mismatch" in e for e in _errors_parsing_in_threads(ast.parse))
    assert _errors_parsing_in_threads(pyast.parse) == []  # ...and never with ours
    assert ast.dump(pyast.parse("x = 1")) == ast.dump(ast.parse("x = 1"))
    assert isinstance(pyast.parse("a + 1", mode="eval"), ast.Expression)
