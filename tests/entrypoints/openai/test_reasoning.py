"""Reasoning output (--reasoning-parser) and tool-call parsers from a file (--tool-parser-plugin).

The parsers are driven on fixed text, whole and in every chunking a stream could bring; the
server tests run the default model, whose replies are forced by guided_regex to hold a
``<think>`` section (SmolLM2 writes none of its own), through the real HTTP path.
"""

from __future__ import annotations

import json
import re
import textwrap
from types import SimpleNamespace

import httpx
import pytest

from fastdeploy_core.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy_core.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningSplit,
    reasoning_parser_class,
    reasoning_token_count,
)
from fastdeploy_core.entrypoints.openai.serving_chat import _ChoiceStream, render_chat_prompt, tool_mode
from fastdeploy_core.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    load_tool_parser_plugin,
    tool_parser_class,
)
from fastdeploy_core.errors import ConfigError, DuplicateRegistrationError
from fastdeploy_core.plugins import load_plugins
from tests.entrypoints.openai.conftest import start_server

# --- the parsers on fixed text ---------------------------------------------------------------

CASES = [
    # (text, qwen3 (reasoning, content), deepseek_r1 (reasoning, content))
    ("<think>Two and two.</think>\n\nFour.", ("Two and two.", "Four."), ("Two and two.", "Four.")),
    ("Four.", ("", "Four."), ("Four.", "")),
    ("Two and two.\n</think>\n\nFour.", ("", "Two and two.\n</think>\n\nFour."), ("Two and two.\n", "Four.")),
    ("  <think>x</think>answer", ("x", "answer"), ("x", "answer")),
    ("<think>cut by max_tok", ("cut by max_tok", ""), ("cut by max_tok", "")),
    ("<think></think>only", ("", "only"), ("", "only")),
    ("<thin", ("", "<thin"), ("<thin", "")),
]


@pytest.mark.parametrize("text,qwen3,r1", CASES)
def test_think_parsers_split_a_finished_reply(text, qwen3, r1):
    q = Qwen3ReasoningParser().partition(text, finished=True)
    d = DeepSeekR1ReasoningParser().partition(text, finished=True)
    assert (q.reasoning, q.content) == qwen3
    assert (d.reasoning, d.content) == r1


def test_reasoning_chars_cover_the_tags():
    assert Qwen3ReasoningParser().partition("<think>ab</think> c", True) == ReasoningSplit("ab", "c", 17)
    assert Qwen3ReasoningParser().partition("c", True).reasoning_chars == 0
    assert DeepSeekR1ReasoningParser().partition("ab", True).reasoning_chars == 2


def test_a_growing_reply_holds_back_what_may_be_a_tag():
    q = Qwen3ReasoningParser()
    assert q.partition("<thi", finished=False) == ReasoningSplit("", "", 0)
    assert q.partition("<think>ab</thi", finished=False) == ReasoningSplit("ab", "", 9)
    assert q.partition("<think>ab</think>\n\n", finished=False) == ReasoningSplit("ab", "", 17)
    assert q.partition("Hel", finished=False) == ReasoningSplit("", "Hel", 0)


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
@pytest.mark.parametrize("text", [t for t, _, _ in CASES] + ["<think>a<b</think>c</think>d", "<<think>x", " \n "])
def test_every_chunking_of_a_stream_adds_up_to_the_finished_split(parser, text):
    final = parser().partition(text, finished=True)
    for step in (1, 2, 3, 5):
        p = parser()
        reasoning = content = ""
        for end in [*range(step, len(text), step), len(text)]:
            split = p.partition(text[:end], finished=end == len(text))
            assert split.reasoning.startswith(reasoning) and split.content.startswith(content), (step, end)
            reasoning, content = split.reasoning, split.content
        assert (reasoning, content) == (final.reasoning, final.content)


def test_reasoning_token_count_finds_the_tokens_of_the_reasoning_chars():
    pieces = ["<think>", "x", "</think>", "ans", "wer"]
    def decode(ids):
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    assert reasoning_token_count(ids, len("<think>x</think>"), decode) == 3
    assert reasoning_token_count(ids, 0, decode) == 0
    assert reasoning_token_count(ids, len("<think>x</think>answer"), decode) == 5


def test_reasoning_parsers_are_registered_through_the_hook():
    pm = load_plugins()
    assert sorted(pm.reasoning_parsers.keys()) == ["deepseek_r1", "qwen3"]
    assert reasoning_parser_class("qwen3", pm) is Qwen3ReasoningParser
    assert reasoning_parser_class(None, pm) is None
    with pytest.raises(ConfigError, match=r"'nope' is not registered \(registered: deepseek_r1, qwen3\)"):
        reasoning_parser_class("nope", pm)


# --- the stream of one choice, without a server -----------------------------------------------


def fake_state(reasoning=Qwen3ReasoningParser, tool_parser=None):
    return SimpleNamespace(reasoning_parser=reasoning, tool_parser=tool_parser, tokenizer=None)


def request(**kw):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def run_stream(state, req, pieces):
    stream = _ChoiceStream(state, req, tool_mode(state, req))
    deltas = []
    for i, piece in enumerate(pieces):
        delta, finish = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
        if delta is not None:
            deltas.append((delta.model_dump(exclude_none=True), finish))
    return deltas


def test_streamed_reasoning_and_content_deltas():
    deltas = run_stream(fake_state(), request(), ["<th", "ink>ab", "c</th", "ink>\n\nFo", "ur."])
    assert [d for d, _ in deltas] == [
        {"reasoning_content": "ab"}, {"reasoning_content": "c"}, {"content": "Fo"}, {"content": "ur."}
    ]
    assert deltas[-1][1] == "stop"


def test_streamed_reasoning_then_a_tool_call_of_the_content():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    state = fake_state(tool_parser=HermesToolParser)
    deltas = run_stream(state, request(tools=tools, tool_choice="auto"),
                        ["<think>call f</think>", "<tool_call>", '{"name": "f", "arguments": {"a": 1}}', "</tool_call>"])
    assert deltas[0] == ({"reasoning_content": "call f"}, None)
    last, finish = deltas[-1]
    assert finish == "tool_calls"
    assert last["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert "content" not in last


def test_json_constraints_and_forced_tool_calls_are_not_split():
    r1 = fake_state(reasoning=DeepSeekR1ReasoningParser)
    deltas = run_stream(r1, request(response_format={"type": "json_object"}), ['{"a":', " 1}"])
    assert [d for d, _ in deltas] == [{"content": '{"a":'}, {"content": " 1}"}]
    deltas = run_stream(r1, request(guided_regex="<think>x</think>y"), ["<think>x</think>", "y"])
    assert [d for d, _ in deltas] == [{"reasoning_content": "x"}, {"content": "y"}]


def test_chat_template_kwargs_reach_the_template():
    tokenizer = SimpleNamespace(
        apply_chat_template=lambda messages, add_generation_prompt, chat_template, max_chars, **kw: (
            f"thinking={kw.get('enable_thinking')} last={messages[-1].get('reasoning_content')}"
        ),
        encode=lambda text, add_special_tokens: [len(text)],
    )
    state = SimpleNamespace(check_chat_template=lambda t: None, chat_template="t", tokenizer=tokenizer,
                            max_prompt_chars=10_000, encode_prompt=lambda text, add_special_tokens, param: [1])
    req = ChatCompletionRequest(model="m", messages=[{"role": "assistant", "content": "4", "reasoning_content": "2+2"}],
                                chat_template_kwargs={"enable_thinking": False})
    assert render_chat_prompt(state, req)[0] == "thinking=False last=2+2"


# --- --tool-parser-plugin FILE ------------------------------------------------------------------

PLUGIN_FILE = textwrap.dedent('''
    """Tool calls written as one line: CALL name {json arguments}."""
    import json
    import re

    from fastdeploy_core.entrypoints.openai.tool_parsers import ParsedReply, ParsedToolCall, ToolParser


    class CallLineParser(ToolParser):
        name = "call_line"
        LINE = re.compile(r"CALL (\\w+) (\\{.*\\})")

        def parse(self, text):
            start = text.find("CALL ")
            match = self.LINE.search(text, start) if start >= 0 else None
            if match is None:
                return ParsedReply(text or None, [])
            args = json.loads(match.group(2))
            return ParsedReply(text[:start].strip() or None, [ParsedToolCall(match.group(1), json.dumps(args))])

        def content_end(self, text):
            start = text.find("C")
            return len(text) if start < 0 else start


    def register_tool_parsers(register):
        register("call_line", CallLineParser)
''')


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(PLUGIN_FILE)
    return str(path)


def test_a_tool_parser_plugin_file_registers_its_parsers(plugin_file):
    pm = load_plugins()
    assert load_tool_parser_plugin(plugin_file, pm) == ["call_line"]
    assert load_tool_parser_plugin(plugin_file, pm) == ["call_line"]  # a second load registers nothing again
    cls = tool_parser_class("call_line", pm)
    reply = cls().parse('Sure. CALL get_weather {"city": "Paris"}')
    assert (reply.content, reply.tool_calls[0].name, reply.tool_calls[0].arguments) == (
        "Sure.", "get_weather", '{"city": "Paris"}'
    )
    assert pm.tool_parsers.entry("call_line").distribution.endswith("my_parsers.py")


@pytest.mark.parametrize("body,says", [
    ("x = 1\n", "defines no register_tool_parsers(register) function"),
    ("def register_tool_parsers(register):\n    register('p', dict)\n", "is not a subclass of"),
    ("raise RuntimeError('boom')\n", "raised RuntimeError: boom"),
])
def test_a_broken_tool_parser_plugin_file_is_refused_with_the_fix(tmp_path, body, says):
    path = tmp_path / "broken.py"
    path.write_text(body)
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        load_tool_parser_plugin(str(path), load_plugins())
    assert err.value.param == "tool_parser_plugin"


def test_a_tool_parser_plugin_file_may_not_take_a_registered_name(tmp_path):
    path = tmp_path / "clash.py"
    path.write_text(PLUGIN_FILE.replace('register("call_line"', 'register("hermes"'))
    with pytest.raises(DuplicateRegistrationError, match="'hermes' is registered twice"):
        load_tool_parser_plugin(str(path), load_plugins())
    with pytest.raises(ConfigError, match="is not a file"):
        load_tool_parser_plugin(str(tmp_path / "missing.py"), load_plugins())


def test_serve_flags_check_the_names(plugin_file):
    from fastdeploy_core.cli.serve import build_configs

    engine, _ = build_configs({}, {"reasoning_parser": "deepseek_r1", "tool_parser_plugin": plugin_file,
                                   "tool_call_parser": "call_line"})
    assert (engine.structured.reasoning_parser, engine.structured.tool_parser_plugin) == ("deepseek_r1", plugin_file)
    with pytest.raises(ConfigError, match="reasoning_parser: 'think' is not registered"):
        build_configs({}, {"reasoning_parser": "think"})


# --- a real server ------------------------------------------------------------------------------

THINK = r"<think>x</think>answer"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("reasoning")
    plugin = d / "my_parsers.py"
    plugin.write_text(PLUGIN_FILE)
    s = start_server(str(d), "--reasoning-parser", "qwen3", "--tool-parser-plugin", str(plugin),
                     "--tool-call-parser", "call_line")
    yield s
    s.stop()


def post(srv, body, stream=False):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Think, then answer."}],
            "temperature": 0, "max_tokens": 40, **body, "stream": stream}
    if not stream:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers(), timeout=300)
        assert r.status_code == 200, r.text
        return r.json()
    chunks = []
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers(),
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_server_splits_a_forced_think_section(srv):
    from fastdeploy_core.loader.model_source import resolve_model_source
    from fastdeploy_core.tokenizer import load_tokenizer

    body = post(srv, {"guided_regex": THINK, "return_token_ids": True})
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("x", "answer")
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    ids = message["completion_token_ids"]
    n = usage["completion_tokens_details"]["reasoning_tokens"]
    tokenizer = load_tokenizer(resolve_model_source(None))
    assert tokenizer.decode(ids[:n]) == "<think>x</think>"
    assert tokenizer.decode(ids[n:]) == "answer" and usage["completion_tokens"] == len(ids)


def test_server_streams_reasoning_content_deltas(srv):
    chunks = post(srv, {"guided_regex": THINK, "stream_options": {"include_usage": True}}, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "x"
    assert "".join(d.get("content", "") for d in deltas) == "answer"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_server_reply_without_think_tags_is_all_content(srv):
    message = post(srv, {"max_tokens": 8})["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    body = post(srv, {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert json.loads(body["choices"][0]["message"]["content"])["a"] in ("x", "y")


def test_server_uses_the_plugin_files_tool_parser_after_the_reasoning(srv):
    regex = r'<think>weather</think>CALL get_weather \{"city": "Paris"\}'
    body = post(srv, {"guided_regex": regex, "tools": [WEATHER], "tool_choice": "auto"})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "weather"
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})


def test_the_guides_tool_parser_plugin_file_works(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "writing-a-plugin.md").read_text(encoding="utf-8")
    snippet = doc.split("```python\n# my_parsers.py\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "my_parsers.py"
    path.write_text(snippet)
    pm = load_plugins()
    assert load_tool_parser_plugin(str(path), pm) == ["call_line"]
    reply = tool_parser_class("call_line", pm)().parse('CALL f {"a": 1}')
    assert (reply.content, reply.tool_calls[0].name, reply.tool_calls[0].arguments) == (None, "f", '{"a": 1}')
