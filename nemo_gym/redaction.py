"""Secrets: which config values are secret, and the one place that hides them.

Contract
--------
* A **secret key** (:func:`is_secret_key`): ``api_key``/``apikey`` anywhere in the name; the words
  secret, password, passwd, credential(s), creds, authorization, cookie(s), bearer, privatekey; a
  last word ``token`` (``hf_token``, not ``max_tokens``); and ``<word>_key`` / ``<word>_key_id``
  (``wandb_key``, ``private_key``, ``aws_access_key_id``) unless ``<word>`` names a data field
  (``answer_key``, ``sort_key``, ``public_key``: see ``_DATA_KEY_WORDS``). The value of a secret key
  is secret when it is a scalar or a list of scalars; a mapping (or list of mappings) is secret as a
  whole only under a key that names a container of credentials (last word credentials, creds,
  secrets, cookies, authorization) and under every ``*headers``/``*header`` key (``extra_headers``,
  ``default_headers``). Other mappings are looked into key by key, so an instance named
  ``secret_probe`` does not make its host a secret.
* **Secret values** (:func:`collect_secret_values`) are the string (and number) leaves under secret
  keys, every ``SecretStr`` value, the password (or lone user part) of every URL with userinfo
  (``https://user:pass@host``), the values of secret-looking query parameters of URLs
  (``?api-key=...``, ``&sig=...``: :func:`is_secret_query_param`), and any extra values a process was
  told of (``ng_run`` tells each server the secret values its own block holds). Values shorter than
  :data:`MIN_SCRUB_LEN` are only hidden where they stand under a secret key, never cut out of other
  text (so ``EMPTY`` or ``1`` do not blank every log line).
* ``env.yaml`` is held to the same rule (:func:`env_yaml_secret_values`), plus any value that looks
  like a well-known credential whatever its key (``sk-...``, ``hf_...``, ``AKIA...``): a base URL or
  a model name stays readable in error messages ("http://host/v1/responses rejected the API key").
* A :class:`Scrubber` replaces every occurrence of a secret value (also in its JSON-escaped forms)
  with :data:`REDACTED` in any text, and the password of any URL with userinfo and the value of any
  secret-looking query parameter. It is a few compiled regular expressions, meant for error and log
  paths and output files, never for the per-request hot path of a server.
* **Environment variables** (:func:`child_environ`): a server started by ``ng_run`` inherits the
  launcher's environment without the secret-looking variables (:func:`is_secret_env_name`:
  ``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``, ``AWS_*``, ...) except those
  its block names in ``pass_env``.
* :func:`redact_config` is what leaves a process as config (head server, ``ng_dump_config``):
  values under secret keys replaced, every other string scrubbed; ``host``/``port`` are kept
  (clients need them to find the servers).
* Each process keeps one scrubber (:func:`process_scrubber`); what the process learns about secrets
  is added with :func:`add_secret_values`. A server started by ``ng_run`` seeds it from its config
  and from :data:`NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME` (a JSON list of its own secret values and the
  run token).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***REDACTED***"
MIN_SCRUB_LEN = 8
NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME = "NEMO_GYM_SECRET_VALUES"
# A server instance's block may name launcher environment variables it needs despite their names.
PASS_ENV_KEY_NAME = "pass_env"

_SECRET_WORDS = frozenset(
    {
        "secret", "secrets", "password", "passwords", "passwd", "apikey", "credential", "credentials",
        "creds", "authorization", "cookie", "cookies", "bearer", "privatekey",
    }
)  # fmt: skip
_SECRET_LAST_WORDS = frozenset({"token"})
_KEY_WORDS = frozenset({"key", "keys"})
# ``<word>_key`` names a credential (wandb_key, private_key) unless <word> says it names a data field
# or a lookup key: these are the exceptions.
_DATA_KEY_WORDS = frozenset(
    {
        "sort", "primary", "foreign", "unique", "partition", "shard", "cache", "dict", "hash", "lookup", "join",
        "group", "index", "map", "row", "column", "col", "field", "answer", "label", "input", "output", "prompt",
        "text", "target", "response", "question", "query", "task", "metric", "reward", "result", "message",
        "content", "image", "audio", "video", "dataset", "data", "sample", "example", "id", "name", "public",
        "config", "truth", "gt", "expected", "solution", "reference", "context", "instruction", "system",
        "user", "tool", "state", "seed", "object", "record", "item", "value", "entry", "problem", "score",
        "sub", "child", "parent", "node", "dedup", "feature", "metadata", "cluster", "routing", "route",
    }
)  # fmt: skip
_HEADER_WORDS = frozenset({"headers", "header"})
_CONTAINER_WORDS = frozenset(
    {"credential", "credentials", "creds", "secret", "secrets", "cookie", "cookies", "authorization"}
)
# Keys that locate servers: never hidden in a config dump (they are not credentials, and clients of
# the head server need them).
_ROUTING_KEYS = frozenset({"host", "port", "entrypoint"})

# scheme://userinfo@ -- the userinfo is ``user:password`` or a lone token.
_URL_USERINFO_RE = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/?#@:\"'<>]*)(?::(?P<pw>[^\s/?#@\"'<>]*))?@"
)
# ``?name=value`` / ``&name=value`` in a URL whose name may be secret-looking (a superset of
# :func:`is_secret_query_param`, which decides): other parameters cost no Python call when scrubbing.
_QUERY_PARAM_RE = re.compile(
    r"(?P<lead>[?&](?P<name>[A-Za-z0-9_.\-]*(?:key|token|secret|pass|pwd|sig|cred|auth|bearer|cookie)"
    r"[A-Za-z0-9_.\-]*)=)(?P<value>[^&#\s\"'<>\\]+)",
    re.IGNORECASE,
)
# Query parameter names that carry a credential besides the secret keys (``api-key``, ``access_token``,
# ``X-Amz-Credential``, ``X-Amz-Security-Token``): Google's ``key``, signed URLs' ``sig``/``signature``.
_SECRET_QUERY_PARAMS = frozenset(
    {"key", "sig", "signature", "x-amz-signature", "x-goog-signature", "auth", "pass"}
)
# Values that are credentials whatever key holds them (OpenAI, Anthropic, NVIDIA, Hugging Face, GitHub,
# Slack, AWS access key ids, Google API keys, JWTs).
_CREDENTIAL_VALUE_RE = re.compile(
    r"^(sk-|sk_|nvapi-|hf_|ghp_|gho_|ghs_|ghu_|github_pat_|xox[abpr]-|AKIA|ASIA|AIza|eyJ)[A-Za-z0-9_\-.]{8,}$"
)


def _key_words(key: str) -> list[str]:
    return [p.lower() for p in re.split(r"[^a-zA-Z0-9]+|(?<=[a-z0-9])(?=[A-Z])", key) if p]


def is_secret_key(key: str) -> bool:
    """True for keys whose value is a credential (see the module docstring for the rule)."""
    lowered = key.lower()
    if "api_key" in lowered or "apikey" in lowered or "api-key" in lowered:
        return True
    words = _key_words(key)
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words) or words[-1] in _SECRET_LAST_WORDS:
        return True
    for i, w in enumerate(words):
        if i > 0 and w in _KEY_WORDS and words[i - 1] not in _DATA_KEY_WORDS:
            rest = words[i + 1 :]
            if not rest or rest in (["id"], ["ids"]):
                return True
    return False


def is_header_key(key: str) -> bool:
    """True for keys that hold HTTP headers (``extra_headers``, ``default_headers``): every value is secret."""
    words = _key_words(key)
    return bool(words) and words[-1] in _HEADER_WORDS


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple)) and not hasattr(value, "model_dump")


def _secret_below(key: str, value: Any) -> bool:
    """Whether ``value``, standing under ``key``, is secret as a whole (see the module docstring)."""
    if is_header_key(key):
        return True
    if not is_secret_key(key):
        return False
    if _is_scalar(value) or (isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value)):
        return True
    return _key_words(key)[-1] in _CONTAINER_WORDS


def url_userinfo_secrets(text: str) -> list[str]:
    """The passwords (or lone user tokens) of the URLs with userinfo in ``text``."""
    if "@" not in text or "://" not in text:
        return []
    out = []
    for m in _URL_USERINFO_RE.finditer(text):
        secret = m.group("pw") if m.group("pw") is not None else m.group("user")
        if secret:
            out.append(secret)
    return out


@functools.lru_cache(maxsize=1024)
def is_secret_query_param(name: str) -> bool:
    """True for URL query parameters whose value is a credential (``api-key``, ``token``, ``sig``...)."""
    return name.lower() in _SECRET_QUERY_PARAMS or is_secret_key(name)


def url_query_secrets(text: str) -> list[str]:
    """The values of the secret-looking query parameters of the URLs in ``text``."""
    if "=" not in text or ("?" not in text and "&" not in text):
        return []
    return [
        m.group("value") for m in _QUERY_PARAM_RE.finditer(text) if is_secret_query_param(m.group("name"))
    ]


def _add_value(value: str, out: set[str]) -> None:
    if len(value) >= MIN_SCRUB_LEN:
        out.add(value)


def collect_secret_values(value: Any, out: set[str] | None = None, secret: bool = False) -> set[str]:
    """Secret values in a plain config (dicts, lists, scalars; pydantic models are dumped first).

    ``secret`` says ``value`` already stands under a secret key. Only values of at least
    :data:`MIN_SCRUB_LEN` characters are returned (shorter ones would blank unrelated text).
    """
    out = set() if out is None else out
    if hasattr(value, "model_dump") and callable(value.model_dump):
        value = value.model_dump()
    if isinstance(value, dict):
        for k, v in value.items():
            collect_secret_values(v, out, secret or _secret_below(str(k), v))
    elif isinstance(value, (list, tuple)):
        for v in value:
            collect_secret_values(v, out, secret)
    elif hasattr(value, "get_secret_value"):  # pydantic SecretStr / SecretBytes
        raw = value.get_secret_value()
        collect_secret_values(raw.decode(errors="replace") if isinstance(raw, bytes) else raw, out, True)
    elif isinstance(value, str):
        if secret:
            _add_value(value, out)
        for s in url_userinfo_secrets(value) + url_query_secrets(value):
            _add_value(s, out)
    elif secret and isinstance(value, (int, float)) and not isinstance(value, bool):
        _add_value(str(value), out)
    return out


def env_yaml_secret_values(env_data: Any) -> set[str]:
    """The secret values of ``env.yaml``: as in any config (values of secret keys such as
    ``policy_api_key``, URL passwords, secret query parameters), plus every value that looks like a
    well-known credential whatever its key. A base URL or a model name is no secret."""
    out = collect_secret_values(env_data)
    _credential_like(env_data, out)
    return out


def _credential_like(value: Any, out: set[str]) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _credential_like(v, out)
    elif isinstance(value, list):
        for v in value:
            _credential_like(v, out)
    elif isinstance(value, str) and _CREDENTIAL_VALUE_RE.match(value.strip()):
        _add_value(value.strip(), out)


def config_secret_values(cfg: Any, env_yaml_data: Any = None) -> set[str]:
    """The secret values of a config (an omegaconf config or a plain one) and of its env.yaml data.

    Interpolations are resolved where possible (``${policy_api_key}`` under ``api_key``).
    """
    container = cfg
    if not isinstance(cfg, (dict, list)):
        from omegaconf import OmegaConf

        try:
            container = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # an unresolvable value must not stop the rest from being found
            container = OmegaConf.to_container(cfg, resolve=False)
    return collect_secret_values(container) | env_yaml_secret_values(env_yaml_data or {})


class Scrubber:
    """Replaces known secret values, and URL passwords, in text (see the module docstring)."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self.values: frozenset[str] = frozenset(
            v for v in values if isinstance(v, str) and len(v) >= MIN_SCRUB_LEN
        )
        forms: set[str] = set()
        for v in self.values:
            forms.add(v)
            forms.add(json.dumps(v)[1:-1])  # as it appears inside JSON text (quotes, backslashes, non-ASCII)
            forms.add(json.dumps(v, ensure_ascii=False)[1:-1])
        # Longest first, so a value that contains another is replaced whole.
        ordered = sorted(forms, key=lambda s: (-len(s), s))
        self._forms = tuple(ordered)
        self._values_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def scrub(self, text: str) -> str:
        """``text`` with every secret value and every URL password replaced by :data:`REDACTED`."""
        # Substring tests first (fast, in C): most text holds no secret and skips the regular expression.
        if self._values_re is not None and any(f in text for f in self._forms):
            text = self._values_re.sub(REDACTED, text)
        if "@" in text and "://" in text:
            text = _URL_USERINFO_RE.sub(_hide_userinfo, text)
        if "=" in text and ("?" in text or "&" in text):
            text = _QUERY_PARAM_RE.sub(_hide_query_value, text)
        return text

    def scrub_bytes(self, data: bytes) -> bytes:
        """:meth:`scrub` for a UTF-8 body (bytes that are not UTF-8 pass through unchanged)."""
        text = data.decode("utf-8", errors="surrogateescape")
        scrubbed = self.scrub(text)
        return data if scrubbed == text else scrubbed.encode("utf-8", errors="surrogateescape")

    def scrub_obj(self, value: Any) -> Any:
        """A copy of a JSON-like value with every string (keys too) scrubbed."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub(k) if isinstance(k, str) else k: self.scrub_obj(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.scrub_obj(v) for v in value]
        return value


def _hide_userinfo(m: re.Match[str]) -> str:
    if m.group("pw") is not None:
        return f"{m.group('scheme')}{m.group('user')}:{REDACTED}@"
    return f"{m.group('scheme')}{REDACTED}@" if m.group("user") else m.group(0)


def _hide_query_value(m: re.Match[str]) -> str:
    return m.group("lead") + REDACTED if is_secret_query_param(m.group("name")) else m.group(0)


def redact_config(value: Any, scrubber: Scrubber | None = None, secret: bool = False, key: str = "") -> Any:
    """A copy of a plain config that can leave the process (see the module docstring).

    Scalars under secret keys become :data:`REDACTED` (a list of scalars as a whole; ``None``, ``""``
    and booleans are shown as they are: there is nothing to hide); every other string is scrubbed.
    Without ``scrubber``, one is built from the secret values of ``value`` itself.
    """
    if scrubber is None:
        scrubber = Scrubber(collect_secret_values(value))
    if isinstance(value, dict):
        return {
            k: redact_config(v, scrubber, secret or _secret_below(str(k), v), str(k))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        if secret and value and all(not isinstance(v, (dict, list, tuple)) for v in value):
            return REDACTED
        return [redact_config(v, scrubber, secret, key) for v in value]
    if value is None or value == "" or isinstance(value, bool):
        return value
    if key in _ROUTING_KEYS and not secret:
        return value
    if secret:
        return REDACTED
    if isinstance(value, str):
        return scrubber.scrub(value)
    return value


# --------------------------------------------------------------------------------------------------
# The environment a server inherits from its launcher.

# Words (of a name split at "_", upper case) and substrings that make an environment variable a secret.
_ENV_SECRET_WORDS = frozenset(
    {"KEY", "KEYS", "TOKEN", "TOKENS", "PAT", "DSN", "COOKIE", "COOKIES", "CREDS", "AUTHORIZATION", "BEARER"}
)
_ENV_SECRET_PARTS = (
    "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "APIKEY", "API_KEY", "ACCESS_KEY",
    "PRIVATE_KEY", "AUTH_TOKEN", "AUTH_SOCK", "AUTH_CONFIG", "DATABASE_URL",
)  # fmt: skip
_ENV_SECRET_PREFIXES = ("AWS_", "AZURE_")


def is_secret_env_name(name: str) -> bool:
    """True for environment variables that hold credentials by their name: ``OPENAI_API_KEY``,
    ``HF_TOKEN``, ``*SECRET*``, ``PGPASSWORD``, ``*CREDENTIAL*``, ``SSH_AUTH_SOCK``, ``AWS_*``, ...
    (``TOKENIZERS_PARALLELISM``, ``RAY_AUTH_MODE`` or ``HF_HOME`` are not)."""
    upper = name.upper()
    if upper.startswith(_ENV_SECRET_PREFIXES) or any(p in upper for p in _ENV_SECRET_PARTS):
        return True
    return any(w in _ENV_SECRET_WORDS for w in upper.split("_"))


def is_secret_env_value(value: str) -> bool:
    """True for a value that carries a credential whatever its variable's name: a URL with a password
    (``HTTPS_PROXY=http://user:pw@proxy:3128``) or a secret query parameter, or a well-known key format
    (``sk-...``, ``hf_...``, ``AKIA...``)."""
    return bool(
        url_userinfo_secrets(value) or url_query_secrets(value) or _CREDENTIAL_VALUE_RE.match(value.strip())
    )


def child_environ(environ: Mapping[str, str], pass_env: Iterable[str] = ()) -> dict[str, str]:
    """``environ`` without its secret-looking variables (by name or by value), except those named in
    ``pass_env`` (a server block's ``pass_env`` list). Everything else (PATH, HOME, locale, venv, CUDA,
    HF, Ray, Python variables, a proxy without credentials) passes."""
    keep = set(pass_env)
    return {
        k: v for k, v in environ.items() if k in keep or not (is_secret_env_name(k) or is_secret_env_value(v))
    }


def own_secret_values(own_block: Any, run_values: Iterable[str]) -> set[str]:
    """The secret values a server's own (resolved) config block holds: those found in it by the rules
    above, and every value of ``run_values`` (the run's secrets) that stands inside one of its strings,
    e.g. a key interpolated into a URL under an innocent name."""
    out = collect_secret_values(own_block)
    strings: list[str] = []
    _strings(own_block, strings)
    text = "\0".join(strings)
    out.update(v for v in run_values if len(v) >= MIN_SCRUB_LEN and v in text)
    return out


def _strings(value: Any, out: list[str]) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, out)
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
        out.append(str(value))


# --------------------------------------------------------------------------------------------------
# The scrubber of this process.

_LOCK = threading.Lock()
_PROCESS_VALUES: set[str] | None = None
_PROCESS_SCRUBBER: Scrubber | None = None


def _values_from_environ() -> set[str]:
    from nemo_gym.launch import launch_value  # a sibling base module

    raw = launch_value(NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME)
    if not raw:
        return set()
    try:
        values = json.loads(raw)
    except ValueError:
        return set()
    return {v for v in values if isinstance(v, str)} if isinstance(values, list) else set()


def add_secret_values(values: Iterable[str]) -> None:
    """Teach this process's scrubber more secret values (short ones are ignored)."""
    global _PROCESS_VALUES, _PROCESS_SCRUBBER
    new = {v for v in values if isinstance(v, str) and len(v) >= MIN_SCRUB_LEN}
    with _LOCK:
        if _PROCESS_VALUES is None:
            _PROCESS_VALUES = _values_from_environ()
        if new - _PROCESS_VALUES or _PROCESS_SCRUBBER is None:
            _PROCESS_VALUES |= new
            _PROCESS_SCRUBBER = Scrubber(_PROCESS_VALUES)


def process_scrubber() -> Scrubber:
    """This process's scrubber: the values of ``NEMO_GYM_SECRET_VALUES`` plus all added since."""
    scrubber = _PROCESS_SCRUBBER
    if scrubber is None:
        add_secret_values(())
        scrubber = _PROCESS_SCRUBBER
        assert scrubber is not None
    return scrubber


def scrub(text: str) -> str:
    """``process_scrubber().scrub(text)``."""
    return process_scrubber().scrub(text)


__all__ = [
    "MIN_SCRUB_LEN",
    "NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME",
    "PASS_ENV_KEY_NAME",
    "REDACTED",
    "Scrubber",
    "add_secret_values",
    "child_environ",
    "collect_secret_values",
    "config_secret_values",
    "env_yaml_secret_values",
    "is_header_key",
    "is_secret_env_name",
    "is_secret_key",
    "is_secret_query_param",
    "own_secret_values",
    "process_scrubber",
    "redact_config",
    "scrub",
    "url_query_secrets",
    "url_userinfo_secrets",
]
