"""``POST /v1/completions`` (the legacy Completions API) through the official ``openai`` SDK.

* vllm_model in front of the repo's fake vLLM backend (a real process speaking vLLM's wire format:
  a byte-level tokenizer, so expected ids are computed here exactly);
* local_model with the real tiny GGUF on the CPU: structure, ids and counts only, never the words
  (greedy output differs between CPUs);
* the scripted model, which does not serve the endpoint: a 404 saying so.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest

from nemo_gym.auth import client_token_for_url
from nemo_gym.tools.testing import metric_value, post_json, running_servers, scrape, server_url
from responses_api_models.local_model import weights

ROOT = Path(__file__).resolve().parents[1]
VLLM_CONFIG = "responses_api_models/vllm_model/configs/vllm_model.yaml"
LOCAL_CONFIG = "responses_api_models/local_model/configs/local_model.yaml"
MODEL = "fake-model"
GREETING = "Hello! I am a fake vLLM model."
TRAINING_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
WAIT_S = 120.0


def _load_fake() -> ModuleType:
    path = ROOT / "responses_api_models/vllm_model/tests/fake_vllm_backend.py"
    spec = importlib.util.spec_from_file_location("completions_test_fake_vllm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


FAKE = _load_fake()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S
    )


def _extra(choice: Any, name: str) -> Any:
    """A field the SDK's ``CompletionChoice`` does not model (kept as an extra)."""
    return (choice.model_extra or {}).get(name)


# -- vllm_model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_vllm() -> Iterator[Any]:
    with FAKE.FakeBackend("C", model=MODEL) as backend:
        yield backend


@pytest.fixture(scope="module")
def vllm_urls(fake_vllm: Any) -> Iterator[dict[str, str]]:
    base = fake_vllm.url + "/v1"
    plain = {"entrypoint": "app.py", "base_url": base, "api_key": "EMPTY", "model": MODEL, "max_retries": 0}
    extra = {
        "policy_base_url": base,
        "policy_api_key": "EMPTY",
        "policy_model_name": MODEL,
        "policy_model": {"responses_api_models": {"vllm_model": {"return_token_id_information": True}}},
        "plain_model": {"responses_api_models": {"vllm_model": plain}},
        "scripted": {"responses_api_models": {"scripted_model": {"entrypoint": "app.py"}}},
    }
    with running_servers([VLLM_CONFIG], extra, with_scripted_model=False) as helper:
        yield {n: server_url(helper, n) for n in ("policy_model", "plain_model", "scripted")}


def test_vllm_text_prompt_with_token_ids(vllm_urls: dict[str, str], fake_vllm: Any) -> None:
    prompt = "Say hi."
    with _client(vllm_urls["policy_model"]) as client:
        answer = client.completions.create(model="ignored", prompt=prompt, max_tokens=64)
    assert answer.object == "text_completion" and len(answer.choices) == 1
    choice = answer.choices[0]
    assert choice.text == GREETING and choice.finish_reason == "stop" and choice.logprobs is None
    generated = FAKE.tokenize(GREETING) + [FAKE.SPECIAL_TOKENS["<|im_end|>"]]
    assert _extra(choice, "prompt_token_ids") == FAKE.tokenize(prompt)
    assert _extra(choice, "generation_token_ids") == generated
    assert _extra(choice, "generation_log_probs") == [FAKE.logprob_of(t, i) for i, t in enumerate(generated)]
    assert _extra(choice, "token_ids") is None  # vLLM's own field: only when the client asked for it
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), len(generated))
    # What the backend was sent: vLLM's return_token_ids and logprobs=0 (left out of the answer above).
    sent = [c["body"] for c in fake_vllm.calls()["requests"] if c["path"] == "/v1/completions"][-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0 and sent["model"] == MODEL


def test_vllm_token_id_prompts_n_and_usage(vllm_urls: dict[str, str]) -> None:
    prompts = [FAKE.tokenize("abc"), FAKE.tokenize("hello there")]
    with _client(vllm_urls["policy_model"]) as client:
        answer = client.completions.create(model="ignored", prompt=prompts, max_tokens=5, n=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:
        assert _extra(choice, "prompt_token_ids") == prompts[choice.index // 2]
        assert _extra(choice, "generation_token_ids") == FAKE.tokenize(GREETING)[:5]
        assert choice.finish_reason == "length" and choice.text == GREETING[:5]
    assert answer.usage is not None and answer.usage.completion_tokens == 4 * 5


def test_vllm_logprobs_and_echo(vllm_urls: dict[str, str]) -> None:
    prompt = "Q:"
    with _client(vllm_urls["plain_model"]) as client:
        plain = client.completions.create(model="ignored", prompt=prompt, max_tokens=6, logprobs=2)
        echoed = client.completions.create(
            model="ignored", prompt=prompt, max_tokens=6, logprobs=2, echo=True
        )
    lp = plain.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == plain.choices[0].text == GREETING[:6]
    assert all(len(top) == 3 for top in lp.top_logprobs)  # the sampled token and 2 alternatives
    assert _extra(plain.choices[0], "generation_token_ids") is None  # this instance returns no ids

    e = echoed.choices[0]
    assert e.text == prompt + GREETING[:6]
    assert e.logprobs is not None and e.logprobs.token_logprobs is not None and e.logprobs.tokens is not None
    assert len(e.logprobs.tokens) == len(prompt) + 6
    assert e.logprobs.token_logprobs[0] is None  # the prompt's first token has nothing to be scored against
    assert e.logprobs.token_logprobs[len(prompt) :] == lp.token_logprobs


def test_vllm_echo_with_ids_splits_prompt_and_generation(vllm_urls: dict[str, str]) -> None:
    with _client(vllm_urls["policy_model"]) as client:
        answer = client.completions.create(model="ignored", prompt="Hi", max_tokens=3, echo=True, logprobs=1)
    choice = answer.choices[0]
    assert choice.text == "Hi" + GREETING[:3]
    assert _extra(choice, "prompt_token_ids") == FAKE.tokenize("Hi")
    gen = _extra(choice, "generation_token_ids")
    assert gen == FAKE.tokenize(GREETING[:3])
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert _extra(choice, "generation_log_probs") == choice.logprobs.token_logprobs[-3:]


def test_vllm_stop(vllm_urls: dict[str, str]) -> None:
    with _client(vllm_urls["policy_model"]) as client:
        answer = client.completions.create(model="ignored", prompt="x", max_tokens=64, stop=["fake", "zzz"])
    choice = answer.choices[0]
    assert choice.text == "Hello! I am a " and choice.finish_reason == "stop"
    assert _extra(choice, "stop_reason") == "fake"


def test_vllm_bad_token_ids_and_prompts(vllm_urls: dict[str, str]) -> None:
    with _client(vllm_urls["policy_model"]) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt=[20, 21, 99999], max_tokens=4)
        message = str(caught.value)
        assert "99999" in message and "`prompt`" in message
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt=[[20, 21], "text"], max_tokens=4)  # type: ignore[list-item]
        assert "`prompt[1]`" in str(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt=[20, -3], max_tokens=4)
        assert "`prompt[1]`" in str(caught.value) and "-3" in str(caught.value)


def test_vllm_completions_counted_in_metrics(vllm_urls: dict[str, str]) -> None:
    url = vllm_urls["plain_model"]
    before = scrape(url)
    resp = post_json(url + "/v1/completions", {"model": "m", "prompt": "Hey", "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    after = scrape(url)
    counted = {
        name: metric_value(after, name) - metric_value(before, name)
        for name in after
        if "token" in name and name.endswith("_total")
    }
    assert any(v == 3 for v in counted.values()) and any(v == 4 for v in counted.values()), counted


def test_scripted_model_does_not_serve_completions(vllm_urls: dict[str, str]) -> None:
    with _client(vllm_urls["scripted"]) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="ignored", prompt="hi", max_tokens=4)
    assert "/v1/completions" in str(caught.value) and "not served" in str(caught.value)


# -- local_model (the real GGUF) ---------------------------------------------------------------------------

local_only = pytest.mark.skipif(
    weights.default_model_unavailable() is not None,
    reason=f"needs the default local model: {weights.default_model_unavailable()}",
)


@pytest.fixture(scope="module")
def local_url() -> Iterator[str]:
    extra = {"policy_model": {"responses_api_models": {"local_model": {"return_token_id_information": True}}}}
    with running_servers([LOCAL_CONFIG], extra, with_scripted_model=False) as helper:
        yield server_url(helper, "policy_model")


@pytest.fixture(scope="module")
def vocab() -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(weights.default_weights_path()), vocab_only=True, verbose=False)


@local_only
def test_local_text_prompt_ids_and_usage(local_url: str, vocab: Any) -> None:
    prompt = "def add(a, b):"
    with _client(local_url) as client:
        answer = client.completions.create(model="ignored", prompt=prompt, max_tokens=8, temperature=0)
    choice = answer.choices[0]
    prompt_ids, gen_ids = _extra(choice, "prompt_token_ids"), _extra(choice, "generation_token_ids")
    assert prompt_ids == vocab.tokenize(prompt.encode(), add_bos=False, special=True)
    assert 1 <= len(gen_ids) <= 8 and len(_extra(choice, "generation_log_probs")) == len(gen_ids)
    assert all(lp <= 0 for lp in _extra(choice, "generation_log_probs"))
    content = gen_ids[:-1] if choice.finish_reason == "stop" else gen_ids  # without the end-of-turn token
    assert choice.text == vocab.detokenize(content).decode("utf-8", errors="replace")
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt_ids), len(gen_ids))


@local_only
def test_local_token_id_prompts_are_evaluated_exactly(local_url: str, vocab: Any) -> None:
    prompts = [vocab.tokenize(b"The sky is", add_bos=False), vocab.tokenize(b"1, 2, 3,", add_bos=False)]
    with _client(local_url) as client:
        answer = client.completions.create(model="ignored", prompt=prompts, max_tokens=3, temperature=0)
        single = client.completions.create(model="ignored", prompt=prompts[0], max_tokens=3, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert _extra(choice, "prompt_token_ids") == prompts[choice.index]
        assert 1 <= len(_extra(choice, "generation_token_ids")) <= 3
    assert _extra(single.choices[0], "prompt_token_ids") == prompts[0]
    total = sum(len(p) for p in prompts)
    assert answer.usage is not None and answer.usage.prompt_tokens == total


@local_only
def test_local_logprobs_and_echo(local_url: str) -> None:
    prompt = "Once upon a time"
    with _client(local_url) as client:
        plain = client.completions.create(
            model="ignored", prompt=prompt, max_tokens=5, temperature=0, logprobs=3
        )
        echoed = client.completions.create(
            model="ignored", prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True
        )
    choice = plain.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    n = len(_extra(choice, "generation_token_ids"))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs == _extra(choice, "generation_log_probs")
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and top[token] == token_lp and all(v <= 0 for v in top.values())
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    e = echoed.choices[0]
    prompt_ids = _extra(e, "prompt_token_ids")
    assert e.text.startswith(prompt)
    assert e.logprobs is not None and e.logprobs.token_logprobs is not None and e.logprobs.tokens is not None
    assert len(e.logprobs.tokens) == len(prompt_ids) + len(_extra(e, "generation_token_ids"))
    # local_model does not score the prompt: its tokens are listed with null log-probabilities.
    assert e.logprobs.token_logprobs[: len(prompt_ids)] == [None] * len(prompt_ids)
    assert all(v is not None for v in e.logprobs.token_logprobs[len(prompt_ids) :])


@local_only
def test_local_stop_cuts_the_text(local_url: str, vocab: Any) -> None:
    """A stop string taken from the model's own first answer; whatever this CPU generates, the text
    never contains the stop string, and a stop ends the text exactly before it."""
    with _client(local_url) as client:
        first = client.completions.create(
            model="ignored", prompt="List three colors:", max_tokens=12, temperature=0
        )
        text = first.choices[0].text
        stop = text[len(text) // 2 :][:3] or "\n"
        answer = client.completions.create(
            model="ignored", prompt="List three colors:", max_tokens=12, temperature=0, stop=[stop]
        )
    choice = answer.choices[0]
    assert stop not in choice.text
    if choice.finish_reason == "stop" and _extra(choice, "stop_reason") == stop:
        full = vocab.detokenize(_extra(choice, "generation_token_ids")).decode(errors="replace")
        assert full.startswith(choice.text) and full[len(choice.text) :].startswith(stop)


@local_only
def test_local_refusals_name_the_field(local_url: str, vocab: Any) -> None:
    with _client(local_url) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt=[1, vocab.n_vocab() + 5], max_tokens=2)
        assert "`prompt[1]`" in str(caught.value) and str(vocab.n_vocab() + 5) in str(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt=[[5], [7, vocab.n_vocab()]], max_tokens=2)
        assert "`prompt[1][1]`" in str(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt="hi", n=2, max_tokens=2)
        assert "`n`" in str(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="ignored", prompt="hi", suffix="!", max_tokens=2)
        assert "`suffix`" in str(caught.value)
