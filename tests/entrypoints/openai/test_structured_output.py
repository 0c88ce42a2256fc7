"""Structured output and tool calling through a real server on the default model, with the
official openai client: response_format, guided_* extras, bad constraints, max_tokens, batches
mixing constrained and unconstrained requests, tool_choice required / named (streamed and not),
a tool round trip, and the hermes / llama3_json parsers."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fastdeploy_core.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from tests.entrypoints.openai.conftest import API_KEY, start_server

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                         "age": {"type": "number", "minimum": 0, "maximum": 30}},
                       "required": ["kind", "age"], "additionalProperties": False}},
     "type": "object", "properties": {"owner": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                      "pet": {"$ref": "#/$defs/pet"}},
     "required": ["owner", "pet"], "additionalProperties": False},
]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                       "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(str(tmp_path_factory.mktemp("structured")), "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oc(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat(oc, content: str, **kw):
    return oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                      temperature=0, **kw)


def test_json_object_and_json_schema_replies_validate(oc):
    r = chat(oc, "Reply with a JSON object with the keys name and color of a cat.", max_tokens=100,
             response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for i, schema in enumerate(SCHEMAS):
        r = chat(oc, "Answer in JSON.", max_tokens=120,
                 response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                         "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_parse_with_a_pydantic_model(oc):
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=10**9)

    parse = getattr(getattr(oc, "beta", oc).chat.completions, "parse", None) or oc.chat.completions.parse
    r = parse(model=MODEL, messages=[{"role": "user", "content": "A city as JSON."}], temperature=0,
              max_tokens=100, response_format=City)
    assert isinstance(r.choices[0].message.parsed, City)


def test_guided_extras_hold_on_chat_and_completions(srv):
    h = srv.headers()
    body = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "temperature": 0, "max_tokens": 10}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "guided_choice": ["yes", "no"]}, headers=h,
                   timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = httpx.post(f"{srv.url}/v1/completions", headers=h, timeout=300,
                   json={"prompt": "Call me at", "max_tokens": 20, "temperature": 0, "guided_regex": r"\d{3}-\d{4}"})
    assert r.status_code == 200 and re.fullmatch(r"\d{3}-\d{4}", r.json()["choices"][0]["text"])
    r = httpx.post(f"{srv.url}/v1/completions", headers=h, timeout=300,
                   json={"prompt": "Pick:", "max_tokens": 10, "temperature": 0,
                         "guided_grammar": 'root ::= "color: " ("red" | "blue")'})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("color: red", "color: blue")
    r = httpx.post(f"{srv.url}/v1/completions", headers=h, timeout=300,
                   json={"prompt": "Favourite colors:", "max_tokens": 60, "temperature": 0, "guided_json": SCHEMAS[1]})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMAS[1])


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "Invalid type: objectx"),
        ({"guided_regex": "a(b"}, "unclosed group"),
        ({"guided_grammar": "start: foo"}, "unknown name"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "give one output constraint"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"tool_choice": "required"}, "none were given"),
    ],
)
def test_bad_constraints_are_400_with_the_message(srv, extra, says):
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers(), timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_max_tokens_inside_a_constraint_is_length_not_an_error(oc):
    r = chat(oc, "Answer in JSON.", max_tokens=4,
             response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4


def test_unconstrained_requests_keep_their_tokens_beside_constrained_ones(oc):
    plain = ["Tell me about the sea.", "Write a haiku about rain."]

    def run(prompt, constrained):
        kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[1]}}} \
            if constrained else {}
        return chat(oc, prompt, max_tokens=24, **kw).choices[0].message.content

    alone = [run(p, False) for p in plain]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, p, False) for p in plain] + [pool.submit(run, "Colors?", True) for _ in range(2)]
        results = [f.result() for f in futures]
    assert results[:2] == alone
    for text in results[2:]:
        jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_tool_choice_required_and_named_give_calls_whose_arguments_validate(oc):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    r = chat(oc, "What is the weather in Paris?", max_tokens=80, tools=[WEATHER, TIME], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    r = chat(oc, "What time is it in Tokyo?", max_tokens=60, tools=[WEATHER, TIME],
             tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_assemble_to_valid_calls(oc, choice):
    stream = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                        temperature=0, max_tokens=80, tools=[WEATHER], tool_choice=choice,
                                        stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] = d.function.name or entry["name"]
                    entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["name"] == "get_weather" and entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER["function"]["parameters"])


def test_tool_round_trip_is_accepted(oc):
    first = chat(oc, "Weather in Oslo?", max_tokens=60, tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 4, "unit": "C"}'},
    ]
    final = oc.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                       tools=[WEATHER])
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


def test_hermes_and_llama3_json_parsers():
    hermes = HermesToolParser()
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n' \
           '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    parsed = hermes.parse(text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"tz": "CET"})]
    assert hermes.parse("no calls here").tool_calls == []
    assert hermes.content_end("Sure <tool_") == len("Sure ")
    assert hermes.content_end("Sure <tool_call>{") == len("Sure ")
    llama = Llama3JsonToolParser()
    parsed = llama.parse('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                         '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}')
    assert [c.name for c in parsed.tool_calls] == ["get_time", "get_weather"] and parsed.content is None
    assert llama.parse("Hello there").tool_calls == [] and llama.content_end("Hello") == 5
