"""structured_outputs against real servers: each format right and wrong, tool-call mode, bad schemas."""

import copy
import json
import pickle
from pathlib import Path

import pytest

from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    running_servers,
    server_url,
    text_response,
)
from resources_servers.structured_outputs.app import check_document

CONFIG = "resources_servers/structured_outputs/configs/structured_outputs.yaml"
AGENT = "structured_outputs_simple_agent"
SERVER = "structured_outputs"

# Scripted answers for the five example rows, in row order: (right, wrong, wrong's error_type).
RIGHT_WRONG = [
    (
        '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": 1969, "genres": ["science fiction"]}',
        '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": "1969", "genres": []}',
        "validation_error",
    ),
    (
        "dish: tomato salad\nservings: 2\nvegetarian: true\ningredients:\n  - {name: tomato, grams: 300}\n"
        "  - {name: red onion, grams: 50}\n  - {name: basil, grams: 10}\n",
        "dish: tomato salad\nservings: [2\n",
        "parse_error",
    ),
    (
        "<station><name>Sonnblick Observatory</name><elevation_m>3106</elevation_m><staffed>true</staffed></station>",
        "<station><name>Sonnblick Observatory</name><elevation_m>high</elevation_m><staffed>true</staffed></station>",
        "validation_error",
    ),
    (
        "planet,moons,gas_giant\nMars,2,false\nJupiter,95,true\nNeptune,16,true\n",
        "planet,moons\nMars,2\n",
        "validation_error",
    ),
    (
        {
            "ticket": {
                "summary": "Login page crashes after auth deploy",
                "priority": "high",
                "component": "auth",
            }
        },
        {"ticket": {"summary": "Login page crashes", "priority": "urgent", "component": "auth"}},
        "validation_error",
    ),
]


# Answers that follow the schema but not the task (the audit's content_free_document and its kin): row,
# answer, failure_reason. Each scored 1.0 before rows carried references (expected_document).
CONTENT_FREE = [
    (
        0,
        '{"title": "", "author": "", "year": 0, "genres": []}',
        "content_free: every value of the document is empty, zero or false: no answer to an extraction task",
    ),
    (
        0,
        '{"title": "The Left Hand of Darkness", "author": "", "year": 1969, "genres": ["science fiction"]}',
        'content_mismatch: at author: expected "Ursula K. Le Guin" or one of ["Ursula Le Guin", '
        '"Ursula Kroeber Le Guin"], got ""',
    ),
    (
        1,
        "dish: ''\nservings: 0\nvegetarian: false\ningredients: []\n",
        "content_free: every value of the document is empty, zero or false: no answer to a conversion task",
    ),
    (
        2,
        "<station><name>Sonnblick Observatory</name><elevation_m>3000</elevation_m>"
        "<staffed>true</staffed></station>",
        "content_mismatch: at station/elevation_m: expected 3106, got 3000",
    ),
    (3, "planet,moons,gas_giant\n", "content_mismatch: at (root): expected 3 items, got 0"),
    (
        3,
        "planet,moons,gas_giant\nMars,2,false\nJupiter,95,true\nSaturn,146,true\n",
        'content_mismatch: at (root): no item matches the expected {"planet": "Neptune", "moons": 16, '
        '"gas_giant": true} (item 2 differs at 2/planet: expected "Neptune", got "Saturn")',
    ),
    (
        4,
        {"ticket": {"summary": "", "priority": "high", "component": "auth"}},
        'content_mismatch: at summary: expected a text mentioning "login", got ""',
    ),
]
# Right answers written otherwise (case, spacing, key and row order, number formats, alternatives the
# row's expected_rules allow): each still earns 1.0.
RIGHT_OTHERWISE = [
    (
        0,
        '{"genres": ["Science Fiction", "political fiction"], "year": 1969.0, "author": "ursula k.  le guin",'
        ' "title": "  THE LEFT HAND OF DARKNESS "}',
    ),
    (
        0,
        '{"title": "The Left Hand of Darkness", "author": "Ursula Le Guin", "year": 1.969e3, "genres": ["SF"]}',
    ),
    (
        1,
        "servings: 2.0\ndish: Tomato Salad\nvegetarian: yes\ningredients:\n- {grams: 10, name: Basil}\n"
        "- {name: tomatoes, grams: 3.0e+2}\n- {name: red onion, grams: 50.0}\n",
    ),
    (
        2,
        "<station>\n  <staffed>1</staffed>\n  <name>sonnblick</name>\n  <elevation_m> 3106 </elevation_m>\n"
        "</station>",
    ),
    (3, "planet,moons,gas_giant\n neptune ,16,TRUE\nMars,2,False\nJUPITER,95,true\n"),
    (4, {"ticket": {"component": "Auth service", "priority": "high", "summary": "Every login crashes"}}),
]


def _turn(answer) -> dict:
    if isinstance(answer, dict):
        return {"tool_calls": [{"name": "file_ticket", "arguments": answer}]}
    return {"text": answer}


def _response(answer) -> dict:
    if isinstance(answer, str):
        return text_response(answer)
    call = {"type": "function_call", "name": "file_ticket", "arguments": json.dumps(answer), "call_id": "c1"}
    return {**text_response(""), "output": [call]}


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out


@pytest.mark.slow
def test_right_and_wrong_answers_in_every_format(tmp_path: Path) -> None:
    rows = example_rows("structured_outputs")
    wrong_rows = [_marked(r, f"[wrong-{i}]") for i, r in enumerate(rows)]
    rules = [{"contains": f"[wrong-{i}]", "turns": [_turn(w)]} for i, (_, w, _) in enumerate(RIGHT_WRONG)]
    rules += [
        {"contains": r["responses_create_params"]["input"][-1]["content"][-60:], "turns": [_turn(right)]}
        for r, (right, _, _) in zip(rows, RIGHT_WRONG, strict=True)
    ]
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}},
        # Every answer goes through the verify pool here (the small-answer inline path is the same function).
        SERVER: {"resources_servers": {SERVER: {"pool_threshold_chars": 0}}},
    }
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows + wrong_rows, tmp_path, AGENT)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0] * 5 + [0.0] * 5, [r["error_message"] for r in out]
        assert [r["error_type"] for r in out] == [None] * 5 + [e for _, _, e in RIGHT_WRONG]
        assert [r["schema_type"] for r in out[:5]] == ["json", "yaml", "xml", "csv", "json"]

        # A schema that is JSON but not a JSON Schema: 422 naming it, not a 0.
        body = {**out[0], "schema_str": json.dumps({"type": "object", "properties": 5})}
        resp = post_json(server_url(helper, SERVER) + "/verify", body)
        assert resp.status_code == 422 and "not a valid JSON Schema" in resp.text

        # Tool arguments nested past json's depth are the model's bad arguments (they were a 500).
        deep = "[" * 1000 + "]" * 1000
        call = {"type": "function_call", "name": "file_ticket", "arguments": deep, "call_id": "c1"}
        body = {**out[4], "response": {**out[4]["response"], "output": [call]}}
        resp = post_json(server_url(helper, SERVER) + "/verify", body)
        assert resp.status_code == 200 and resp.json()["reward"] == 0.0, resp.text[:500]
        assert resp.json()["error_type"] == "tool_arguments_parse_error"
        assert resp.json()["failure_reason"].startswith("tool_arguments_parse_error: RecursionError")
        assert out[0]["failure_reason"] is None and out[5]["failure_reason"].startswith("validation_error: ")

        # Content-free answers and wrong values score 0 with the first field that differs; right answers
        # written otherwise still earn 1.
        url = server_url(helper, SERVER) + "/verify"
        for i, answer, reason in CONTENT_FREE:
            resp = post_json(url, {**out[i], "response": _response(answer)})
            assert resp.status_code == 200, resp.text[:500]
            assert (resp.json()["reward"], resp.json()["failure_reason"]) == (0.0, reason), (i, answer)
        for i, answer in RIGHT_OTHERWISE:
            resp = post_json(url, {**out[i], "response": _response(answer)})
            assert resp.status_code == 200 and resp.json()["reward"] == 1.0, resp.json()["failure_reason"]
        # A row without a reference whose problem_type is not extraction or conversion is scored on form
        # only (upstream's rule): the content-free document earns.
        bare = {k: v for k, v in out[0].items() if k not in ("expected_document", "expected_rules")}
        bare["problem_type"] = None
        resp = post_json(url, {**bare, "response": _response(CONTENT_FREE[0][1])})
        assert resp.status_code == 200 and resp.json()["reward"] == 1.0
        # A rule the row's reference has no place for is bad data (a 422), not a 0.
        resp = post_json(url, {**out[0], "expected_rules": {"/genre": "contains"}})
        assert resp.status_code == 422 and "expected_rules" in resp.text and "/genre" in resp.text

        # Rows with a schema_str that is not JSON, an unknown format or no schema are refused up front.
        bad = [rows[0], {**rows[1], "schema_str": "{type: object"}, {**rows[2], "schema_type": "ini"}]
        bad.append({k: v for k, v in rows[3].items() if k != "schema_str"})
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == []
        assert "input.jsonl:2: field `schema_str` must be JSON text" in err
        assert "input.jsonl:3: field `schema_type` has unknown value(s)" in err
        assert "input.jsonl:4: missing field `schema_str`" in err


SCHEMA = json.dumps(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["string", "null"]}}}
)


@pytest.mark.parametrize(
    ("schema_type", "text", "want"),
    [
        ("json", '{"a": 1, "b": null}', (1.0, None)),
        ("json", '{"a": 1}', (0.0, "validation_error")),  # strict: every property is required
        ("json", '{"a": 1, "b": "x", "c": 2}', (0.0, "validation_error")),  # and no others
        ("json", "   ", (0.0, "empty_response")),
        ("toml", 'a = 3\nb = "x"\n', (1.0, None)),
        ("toml", "a = \n", (0.0, "parse_error")),
        ("yaml", "a: 2\nb: null\n", (1.0, None)),
        ("xml", "<r><a>7</a><b>x</b></r>", (0.0, "validation_error")),  # the root element wraps the object
        # One document, plain data: a key given twice, NaN / infinities, YAML aliases are not accepted
        # (upstream: the last key wins, NaN passes `number` and every bound, aliases expand without end).
        ("json", '{"a": 1, "b": "x", "a": 2}', (0.0, "parse_error")),
        ("json", '{"a": NaN, "b": null}', (0.0, "parse_error")),
        ("yaml", "a: 2\nb: x\na: 3\n", (0.0, "parse_error")),
        ("yaml", "b: &b x\na: 2\nc: *b\n", (0.0, "parse_error")),
        ("yaml", "a: 2\nb: &anchor_alone x\n", (1.0, None)),  # an anchor no alias uses is harmless
    ],
)
def test_check_document(schema_type: str, text: str, want: tuple) -> None:
    reward, error_type, _ = check_document(SCHEMA, schema_type, text)
    assert (reward, error_type) == want


def test_a_schema_is_checked_once_per_process_and_a_bad_one_every_time() -> None:
    """The metaschema check and the validator are made once per distinct schema (they cost milliseconds
    on the event loop); verdicts are the same from the cache, and a bad schema is never cached."""
    from resources_servers.structured_outputs.app import InvalidSchema, _checked_schema

    schema = json.dumps({"type": "object", "properties": {"only_in_this_test": {"type": "integer"}}})
    before = (_checked_schema.misses, _checked_schema.hits)
    verdicts = [check_document(schema, "json", text)[:2] for text in ('{"only_in_this_test": 1}', "{}", "[")]
    verdicts += [check_document(schema, "json", '{"only_in_this_test": 2}')[:2]]
    assert verdicts == [(1.0, None), (0.0, "validation_error"), (0.0, "parse_error"), (1.0, None)]
    assert (_checked_schema.misses - before[0], _checked_schema.hits - before[1]) == (1, 3)
    size = len(_checked_schema)
    for _ in range(2):
        with pytest.raises(InvalidSchema, match="not a valid JSON Schema"):
            check_document(json.dumps({"type": 12}), "json", "{}")
    assert len(_checked_schema) == size
    # Sent to another process (a Ray task pickles check_document by value), the cache travels empty.
    copy = pickle.loads(pickle.dumps(_checked_schema))
    assert len(copy) == 0 and copy(schema)[0]["type"] == "object"


NUMBERS = json.dumps({"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}})


@pytest.mark.parametrize(
    ("schema_type", "text"),
    [
        ("json", '{"x": 1e999}'),
        ("yaml", "x: .nan\n"),
        ("yaml", "x: -.inf\n"),
        ("toml", "x = nan\n"),
        ("xml", "<r><x>inf</x></r>"),
    ],
)
def test_numbers_that_are_not_finite_are_not_json_numbers(schema_type: str, text: str) -> None:
    schema = NUMBERS
    if schema_type == "xml":  # the root element wraps the object
        schema = json.dumps({"type": "object", "properties": {"r": json.loads(NUMBERS)}})
    reward, error_type, message = check_document(schema, schema_type, text)
    assert (reward, error_type) == (0.0, "validation_error")
    assert message.endswith("x: a number that is not finite (NaN or infinity)")
    assert check_document(NUMBERS, "json", '{"x": 0.5}') == (1.0, None, None)


def test_a_yaml_alias_bomb_is_refused_before_it_is_read() -> None:
    """A few hundred characters of nested aliases stand for 10^8 nodes; validating them (and printing
    them into the error message) took seconds per level on the event loop."""
    levels = ["a: &a [x,x,x,x,x,x,x,x,x,x]"]
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        levels.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]")
    bomb = "\n".join(levels) + "\nx: [*h]\n"
    reward, error_type, message = check_document(NUMBERS, "yaml", bomb)
    assert (reward, error_type) == (0.0, "parse_error") and "aliases (*name) are not allowed" in message
