"""Unit tests of the redaction rules (``nemo_gym.redaction``): keys, values, URLs, the scrubber."""

from __future__ import annotations

import json

import orjson
import pytest
from pydantic import BaseModel, SecretStr

from nemo_gym.redaction import (
    MIN_SCRUB_LEN,
    REDACTED,
    Scrubber,
    child_environ,
    collect_secret_values,
    env_yaml_secret_values,
    is_header_key,
    is_secret_env_name,
    is_secret_key,
    own_secret_values,
    redact_config,
)


@pytest.mark.parametrize(
    "key",
    [
        "private_key",
        "privateKey",
        "wandb_key",
        "hf_key",
        "aws_access_key_id",
        "aws_secret_access_key",
        "AWS_SECRET_ACCESS_KEY",
        "credentials",
        "google_credentials",
        "creds",
        "authorization",
        "Authorization",
        "cookie",
        "session_cookies",
        "signing_keys",
    ],
)
def test_more_secret_keys(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["answer_key", "sort_key", "public_key", "primary_key", "key", "keys", "key_name", "keyboard", "max_tokens",
     "ground_truth_key", "label_key", "keys_to_keep", "author", "passthrough"],
)  # fmt: skip
def test_data_keys_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


def test_header_keys() -> None:
    assert all(is_header_key(k) for k in ("extra_headers", "default_headers", "headers", "http_header"))
    assert not any(is_header_key(k) for k in ("header_row", "headings"))


def test_everything_under_headers_and_credentials_is_secret() -> None:
    config = {
        "extra_headers": {"OpenAI-Organization": "org-0123456789"},
        "credentials": {"username": "someone-long", "pin": "pin-0123456789"},
        "plain": {"username": "visible-user"},
    }
    out = redact_config(config)
    assert out["extra_headers"] == {"OpenAI-Organization": REDACTED}
    assert out["credentials"] == {"username": REDACTED, "pin": REDACTED}
    assert out["plain"] == {"username": "visible-user"}
    assert collect_secret_values(config) == {"org-0123456789", "someone-long", "pin-0123456789"}


def test_a_secret_word_in_an_instance_name_does_not_make_its_block_secret() -> None:
    config = {
        "secret_probe": {"resources_servers": {"secret_probe": {"host": "127.0.0.1", "note": "hello world"}}},
        "secret_probe_agent": {"responses_api_agents": {"a": {"resources_server": {"name": "secret_probe"}}}},
    }
    assert collect_secret_values(config) == set()
    assert redact_config(config) == config


def test_url_passwords_are_hidden_and_become_secret_values() -> None:
    config = {
        "db_url": "postgresql://probe:pw-0123456789@db.internal:5432/x",
        "token_url": "https://ghp_0123456789abcdef@github.com/org/repo.git",
        "plain_url": "https://api.openai.com/v1",
    }
    out = redact_config(config)
    assert out["db_url"] == f"postgresql://probe:{REDACTED}@db.internal:5432/x"
    assert out["token_url"] == f"https://{REDACTED}@github.com/org/repo.git"
    assert out["plain_url"] == "https://api.openai.com/v1"
    assert collect_secret_values(config) == {"pw-0123456789", "ghp_0123456789abcdef"}
    scrubber = Scrubber()  # even knowing no value, URL passwords in any text are hidden
    assert (
        scrubber.scrub("connect postgresql://u:short@h failed")
        == f"connect postgresql://u:{REDACTED}@h failed"
    )
    assert scrubber.scrub("mail me at someone@example.com") == "mail me at someone@example.com"


def test_secret_str_values_are_found() -> None:
    class Config(BaseModel):
        openai_api_key: SecretStr
        innocent: SecretStr

    assert collect_secret_values(Config(openai_api_key="sk-0123456789", innocent="hidden-0123456789")) == {
        "sk-0123456789",
        "hidden-0123456789",
    }


def test_env_yaml_secrets_are_its_credentials_not_its_urls_or_model_names() -> None:
    env = {
        "policy_base_url": "https://gw.example.com/v1?api-version=2024-10&api-key=QUERYKEY-0123456789",
        "judge_base_url": "https://judge:URLPASS-0123456789@judge.example.com/v1",
        "policy_model_name": "meta/llama-3.3-70b-instruct",
        "policy_api_key": "KEYVALUE-0123456789",
        "odd_name": "nvapi-0123456789abcdef",  # a well-known key format under an innocent name
        "nested": {"hf_token": ["TOKENVALUE-0123456789"]},
        "host": "10.0.0.12345",
        "port": 8000,
        "flag": True,
    }
    assert env_yaml_secret_values(env) == {
        "QUERYKEY-0123456789",
        "URLPASS-0123456789",
        "KEYVALUE-0123456789",
        "nvapi-0123456789abcdef",
        "TOKENVALUE-0123456789",
    }


def test_an_error_message_keeps_the_endpoint_and_loses_the_key() -> None:
    env = {
        "policy_base_url": "https://gw.example.com/v1?api-version=2024-10&api-key=QUERYKEY-0123456789",
        "policy_api_key": "KEYVALUE-0123456789",
        "policy_model_name": "meta/llama-3.3-70b-instruct",
    }
    scrubber = Scrubber(env_yaml_secret_values(env))
    message = (
        f"{env['policy_base_url']} rejected the API key KEYVALUE-0123456789 for "
        f"{env['policy_model_name']}; also tried https://u:pw-0123456789@other.example.com/x?sig=SIG0123456789&n=2"
    )
    assert scrubber.scrub(message) == (
        f"https://gw.example.com/v1?api-version=2024-10&api-key={REDACTED} rejected the API key {REDACTED} for "
        f"meta/llama-3.3-70b-instruct; also tried https://u:{REDACTED}@other.example.com/x?sig={REDACTED}&n=2"
    )


def test_secret_looking_environment_variables() -> None:
    secret = ["OPENAI_API_KEY", "HF_TOKEN", "GITHUB_TOKEN", "PGPASSWORD", "AWS_REGION", "AWS_SECRET_ACCESS_KEY",
              "GOOGLE_APPLICATION_CREDENTIALS", "SSH_AUTH_SOCK", "WANDB_API_KEY", "MY_SERVICE_SECRET",
              "NEMO_GYM_AUTH_TOKEN", "DATABASE_URL", "azure_openai_key", "SENTRY_DSN", "GITHUB_PAT"]  # fmt: skip
    kept = ["PATH", "HOME", "LANG", "LC_ALL", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_OFFLINE",
            "RAY_AUTH_MODE", "RAY_TMPDIR", "PYTHONPATH", "TOKENIZERS_PARALLELISM", "KEYRING_BACKEND", "TMPDIR",
            "NEMO_GYM_RUN_DIR", "XDG_RUNTIME_DIR"]  # fmt: skip
    assert [n for n in secret if not is_secret_env_name(n)] == []
    assert [n for n in kept if is_secret_env_name(n)] == []
    env = {n: "v" for n in secret + kept}
    assert set(child_environ(env)) == set(kept)
    assert set(child_environ(env, ["OPENAI_API_KEY"])) == {*kept, "OPENAI_API_KEY"}


def test_environment_variables_whose_value_is_a_credential() -> None:
    """A proxy URL with a password, a URL with a token parameter, a bare key under an innocent name: the
    name says nothing, the value does (before: all of them reached every server)."""
    env = {
        "HTTPS_PROXY": "http://alice:pr0xy-pw-0123@proxy.corp:3128",
        "https_proxy": "http://bob:another-pw-0123@proxy.corp:3128",
        "STORE_URL": "https://store.example.com/bucket?sig=SIGNATURE0123456789&n=1",
        "MY_OPENAI": "sk-proj-0123456789abcdef",
        "NO_PROXY": "localhost,127.0.0.1",
        "HTTP_PROXY": "http://proxy.corp:3128",
        "DOCS_URL": "https://docs.example.com/a?page=2",
        "GREETING": "hello@example.com",
    }
    assert set(child_environ(env)) == {"NO_PROXY", "HTTP_PROXY", "DOCS_URL", "GREETING"}
    assert "HTTPS_PROXY" in child_environ(env, ["HTTPS_PROXY"])


def test_own_secret_values_are_those_a_block_holds() -> None:
    run_values = {"ENVTOKEN-0123456789", "OTHERKEY-0123456789"}
    block = {"upstream_url": "http://h:1/ENVTOKEN-0123456789/v1", "api_key": "MYKEY-0123456789", "n": 3}
    assert own_secret_values(block, run_values) == {"ENVTOKEN-0123456789", "MYKEY-0123456789"}


def test_scrubber_replaces_values_longest_first_and_in_json_escaped_forms() -> None:
    secret = 'pa"ss\\wörd-0123'
    scrubber = Scrubber(["abcdefgh", "abcdefghij-longer", "short", secret])
    assert scrubber.scrub("x abcdefghij-longer y abcdefgh z short") == f"x {REDACTED} y {REDACTED} z short"
    body = orjson.dumps({"error": f"bad {secret}"})
    assert (
        secret not in scrubber.scrub_bytes(body).decode() and REDACTED in scrubber.scrub_bytes(body).decode()
    )
    ascii_body = json.dumps({"error": f"bad {secret}"}).encode()  # non-ASCII escaped as \\u00f6
    assert REDACTED in scrubber.scrub_bytes(ascii_body).decode()
    assert scrubber.scrub_obj({"a": [f"x{secret}"], "n": 1}) == {"a": [f"x{REDACTED}"], "n": 1}
    assert len("short") < MIN_SCRUB_LEN


def test_scrub_bytes_keeps_bodies_without_secrets_identical() -> None:
    body = b'{"ok": true, "bytes": "\\xff"}' + b"\xff"
    assert Scrubber(["abcdefgh"]).scrub_bytes(body) is body
