"""Reading JSONL files of objects with errors that name the file and line.

Contract: :func:`iter_jsonl_objects` yields ``(line number, object)`` for each non-blank line, lazily;
a line that is not JSON, or not a JSON object, raises ``error`` (``ValueError`` by default) with
``<path>:<line>: ...`` and stops the iteration.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


def iter_jsonl_objects(
    path: str | Path, error: type[Exception] = ValueError
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank line of ``path`` (see the module docstring)."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise error(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
            yield line_no, obj
