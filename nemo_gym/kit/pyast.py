"""``ast.parse`` that is safe to call from several threads at once.

CPython 3.11 keeps the depth counter of its AST conversion in state shared by every thread of the
interpreter; a thread switch in the middle of a conversion (the garbage collector can run Python code
there) lets two parses corrupt it, and one of them fails with ``SystemError: AST constructor recursion
depth mismatch`` (CPython gh-106905, fixed in 3.12.4 and 3.13, never in 3.11). A verifier that parses
code on a worker thread, several rollouts at once, would report that as an error of its own. Every
parse here takes one process-wide lock: parses are short, and a blocked parse waits microseconds.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>", mode: str = "exec", **kwargs: Any) -> Any:
    """:func:`ast.parse`, one parse at a time in this process."""
    with _LOCK:
        return ast.parse(source, filename, mode, **kwargs)
