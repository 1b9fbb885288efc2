"""Each tool-call format on real-shaped outputs, whole and streamed at every split point."""

from __future__ import annotations

import json

import pytest

from freetoken_agent.chat import (
    FormatError, TextDelta, ToolCallFinished, ToolCallStarted, collect, make_parser, parse_tool_calls,
)

TOOLS = [
    {"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {
        "timeout": {"type": "integer"}, "verbose": {"type": "boolean"}, "paths": {"type": "array"}}}}},
]
EDIT = {"path": "src/calc.py", "old": "return a - b", "new": "return a + b\n"}
RUN = {"timeout": 30, "verbose": True, "paths": ["tests/"]}

# (format, output, text outside the calls, [(name, arguments), ...])
SAMPLES = [
    ("hermes",
     'I will fix it. <tool_call>\n{"name": "edit_file", "arguments": {"path": "src/calc.py", "old": "return a - b", '
     '"new": "return a + b\\n"}}\n</tool_call>\n<tool_call>\n{"name": "run_tests", "arguments": {"timeout": 30, '
     '"verbose": true, "paths": ["tests/"]}}\n</tool_call>',
     "I will fix it. \n", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("qwen3_coder",
     "Fixing now.\n<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/calc.py\n</parameter>\n<parameter=old>\n"
     "return a - b\n</parameter>\n<parameter=new>\nreturn a + b\n\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=run_tests>\n<parameter=timeout>\n30\n</parameter>\n<parameter=verbose>\nTrue\n"
     "</parameter>\n<parameter=paths>\n[\"tests/\"]\n</parameter>\n</function>\n</tool_call>",
     "Fixing now.\n\n", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("glm45",
     "Let me edit.<tool_call>edit_file\n<arg_key>path</arg_key>\n<arg_value>src/calc.py</arg_value>\n"
     "<arg_key>old</arg_key>\n<arg_value>return a - b</arg_value>\n<arg_key>new</arg_key>\n<arg_value>return a + b\n"
     "</arg_value>\n</tool_call><tool_call>run_tests\n<arg_key>timeout</arg_key>\n<arg_value>30</arg_value>\n"
     "<arg_key>verbose</arg_key>\n<arg_value>true</arg_value>\n<arg_key>paths</arg_key>\n"
     "<arg_value>[\"tests/\"]</arg_value>\n</tool_call>",
     "Let me edit.", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("deepseek",  # V3: type, name line, fenced JSON
     "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>edit_file\n```json\n"
     '{"path": "src/calc.py", "old": "return a - b", "new": "return a + b\\n"}\n```<｜tool▁call▁end｜>\n'
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>run_tests\n```json\n"
     '{"timeout": 30, "verbose": true, "paths": ["tests/"]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("deepseek",  # V3.1: name, separator, raw JSON
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>edit_file<｜tool▁sep｜>"
     '{"path": "src/calc.py", "old": "return a - b", "new": "return a + b\\n"}<｜tool▁call▁end｜>'
     '<｜tool▁call▁begin｜>run_tests<｜tool▁sep｜>{"timeout": 30, "verbose": true, "paths": ["tests/"]}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("kimi_k2",
     "I'll edit the file.<|tool_calls_section_begin|><|tool_call_begin|>functions.edit_file:0"
     '<|tool_call_argument_begin|>{"path": "src/calc.py", "old": "return a - b", "new": "return a + b\\n"}'
     "<|tool_call_end|><|tool_call_begin|>functions.run_tests:1<|tool_call_argument_begin|>"
     '{"timeout": 30, "verbose": true, "paths": ["tests/"]}<|tool_call_end|><|tool_calls_section_end|>',
     "I'll edit the file.", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("minimax_m2",
     "<think>\nthe sign is wrong\n</think>\n\n<minimax:tool_call>\n<invoke name=\"edit_file\">\n"
     "<parameter name=\"path\">src/calc.py</parameter>\n<parameter name=\"old\">return a - b</parameter>\n"
     "<parameter name=\"new\">return a + b\n</parameter>\n</invoke>\n<invoke name=\"run_tests\">\n"
     "<parameter name=\"timeout\">30</parameter>\n<parameter name=\"verbose\">true</parameter>\n"
     "<parameter name=\"paths\">[\"tests/\"]</parameter>\n</invoke>\n</minimax:tool_call>",
     "<think>\nthe sign is wrong\n</think>\n\n", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("mistral",  # v0.3: one JSON list
     'Calling tools.[TOOL_CALLS] [{"name": "edit_file", "arguments": {"path": "src/calc.py", "old": "return a - b", '
     '"new": "return a + b\\n"}, "id": "abc123xyz"}, {"name": "run_tests", "arguments": {"timeout": 30, '
     '"verbose": true, "paths": ["tests/"]}, "id": "def456uvw"}]',
     "Calling tools.", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("mistral",  # v11+: NAME[ARGS]{json} per call
     '[TOOL_CALLS]edit_file[ARGS]{"path": "src/calc.py", "old": "return a - b", "new": "return a + b\\n"}'
     '[TOOL_CALLS]run_tests[ARGS]{"timeout": 30, "verbose": true, "paths": ["tests/"]}',
     "", [("edit_file", EDIT), ("run_tests", RUN)]),
    ("harmony",
     "<|channel|>analysis<|message|>The subtraction should be an addition.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.edit_file <|constrain|>json<|message|>"
     '{"path": "src/calc.py", "old": "return a - b", "new": "return a + b\\n"}<|call|>',
     "", [("edit_file", EDIT)]),
    ("harmony",  # recipient in the role part; the final <|call|> stripped as a stop token
     "<|channel|>final<|message|>Running the tests now.<|end|><|start|>assistant to=functions.run_tests"
     '<|channel|>commentary json<|message|>{"timeout": 30, "verbose": true, "paths": ["tests/"]}',
     "Running the tests now.", [("run_tests", RUN)]),
]
IDS = [f"{fmt}-{i}" for i, (fmt, *_rest) in enumerate(SAMPLES)]


def _check(events: list, text: str, calls: list) -> None:
    out = collect(events)
    assert out.errors == []
    assert out.text == text
    assert [(c.name, c.arguments) for c in out.calls] == calls
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    finished = [e for e in events if isinstance(e, ToolCallFinished)]
    assert [(e.index, e.name) for e in started] == [(e.index, e.name) for e in finished]
    for ev in finished:  # every call is announced before it finishes
        assert events.index(ToolCallStarted(ev.index, ev.name)) < events.index(ev)


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), SAMPLES, ids=IDS)
def test_whole_output(fmt: str, output: str, text: str, calls: list) -> None:
    parser = make_parser(fmt, TOOLS)
    _check([*parser.feed(output), *parser.finish()], text, calls)


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), SAMPLES, ids=IDS)
def test_split_at_every_position(fmt: str, output: str, text: str, calls: list) -> None:
    for cut in range(1, len(output)):
        parser = make_parser(fmt, TOOLS)
        events = [*parser.feed(output[:cut]), *parser.feed(output[cut:]), *parser.finish()]
        _check(events, text, calls)


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), SAMPLES, ids=IDS)
def test_char_by_char_streams_early(fmt: str, output: str, text: str, calls: list) -> None:
    parser = make_parser(fmt, TOOLS)
    events: list = []
    started_at: dict[int, int] = {}
    finished_at: dict[int, int] = {}
    for pos, ch in enumerate(output):
        for ev in parser.feed(ch):
            events.append(ev)
            if isinstance(ev, ToolCallStarted):
                started_at[ev.index] = pos
            if isinstance(ev, ToolCallFinished):
                finished_at[ev.index] = pos
            if isinstance(ev, TextDelta):  # text is released as soon as it cannot be a marker
                assert "<|" not in ev.text and "<tool_call" not in ev.text and "[TOOL" not in ev.text
    events += parser.finish()
    _check(events, text, calls)
    # the name is known while the arguments are still streaming, long before the call closes
    for index, pos in started_at.items():
        assert pos < finished_at.get(index, len(output)) - 10


def test_text_that_only_looks_like_a_marker_is_released() -> None:
    parser = make_parser("hermes")
    events = parser.feed("if a <tool")
    assert collect(events).text == "if a "
    events += parser.feed("> b: use <tool_call")
    events += parser.feed("s> here")
    events += parser.finish()
    assert collect(events).text == "if a <tool> b: use <tool_calls> here"


@pytest.mark.parametrize(("fmt", "bad"), [
    ("hermes", '<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py",}}\n</tool_call>'),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>edit_file<｜tool▁sep｜>{path: a.py}<｜tool▁call▁end｜>"
                 "<｜tool▁calls▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.edit_file:0<|tool_call_argument_begin|>"
                '{"path": "a.py"<|tool_call_end|><|tool_calls_section_end|>'),
    ("mistral", '[TOOL_CALLS]edit_file[ARGS]{"path": "a.py", '),
    ("harmony", "<|channel|>commentary to=functions.edit_file <|constrain|>json<|message|>{'path': 'a.py'}<|call|>"),
])
def test_malformed_arguments_become_a_format_error(fmt: str, bad: str) -> None:
    parser = make_parser(fmt)
    events = [*parser.feed("before " + bad + (" after" if fmt != "mistral" else "")), *parser.finish()]
    out = collect(events)
    assert out.calls == []
    assert len(out.errors) == 1
    err = out.errors[0]
    assert err.name == "edit_file" and err.index == 0  # the started call is closed by its error
    assert "JSON" in err.message
    assert ToolCallStarted(0, "edit_file") in events


def test_a_call_after_a_format_error_still_parses() -> None:
    bad = '<tool_call>\n{"name": "edit_file", "arguments": [1]}\n</tool_call>'
    good = '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'
    out = parse_tool_calls(f"{bad} then {good} done", "hermes")
    assert [e.message for e in out.errors] == ["the tool call arguments must be a JSON object"]
    assert [(c.index, c.name, c.arguments) for c in out.calls] == [(1, "run_tests", {})]
    assert out.text == " then  done"


def test_block_without_a_call_is_a_format_error() -> None:
    out = parse_tool_calls("<tool_call>\nI want to edit the file\n</tool_call>", "hermes")
    assert out.calls == [] and len(out.errors) == 1 and out.errors[0].index is None


def test_truncated_block_at_end_of_output() -> None:
    out = parse_tool_calls('<tool_call>\n{"name": "run_tests", "arguments": {"timeout": 3', "hermes")
    assert out.calls == [] and out.errors and out.errors[0].name == "run_tests"


def test_unclosed_but_complete_call_is_accepted() -> None:  # the closing marker was a stop string
    out = parse_tool_calls('<tool_call>\n{"name": "run_tests", "arguments": {}}\n', "hermes")
    assert [(c.name, c.arguments) for c in out.calls] == [("run_tests", {})] and out.errors == []


def test_harmony_reasoning_is_marked() -> None:
    out = parse_tool_calls("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
                           "<|message|>answer<|return|>", "harmony")
    assert (out.reasoning, out.text) == ("think", "answer")


def test_harmony_parser_passes_plain_text_through() -> None:
    assert parse_tool_calls("no harmony here", "harmony").text == "no harmony here"


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'"):
        make_parser("nope")


def test_format_error_is_an_event() -> None:
    events = make_parser("glm45").feed("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>")
    assert any(isinstance(e, FormatError) for e in events)


BIG = "".join(f'def f{i}(x):\n    return {{"k": [x, "{i}"]}}  # <|>]}} ｜ </parameter\n' for i in range(300))
BIG_CALLS = {
    "hermes": '<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps({"path": "a.py", "content": BIG})
              + "}\n</tool_call>",
    "qwen3_coder": f"<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n{BIG}"
                   "\n</parameter>\n</function>\n</tool_call>",
    "glm45": f"<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n<arg_key>content</arg_key>\n"
             f"<arg_value>{BIG}</arg_value>\n</tool_call>",
    "minimax_m2": f'<minimax:tool_call>\n<invoke name="write_file">\n<parameter name="path">a.py</parameter>\n'
                  f'<parameter name="content">{BIG}</parameter>\n</invoke>\n</minimax:tool_call>',
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>write_file<｜tool▁sep｜>"
                + json.dumps({"path": "a.py", "content": BIG}) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>"
               + json.dumps({"path": "a.py", "content": BIG}) + "<|tool_call_end|><|tool_calls_section_end|>",
    "mistral": "[TOOL_CALLS]write_file[ARGS]" + json.dumps({"path": "a.py", "content": BIG}),
    "harmony": "<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>"
               + json.dumps({"path": "a.py", "content": BIG}) + "<|call|>",
}


@pytest.mark.parametrize("fmt", sorted(BIG_CALLS))
def test_large_call_streamed_in_small_pieces(fmt: str) -> None:
    """A 20 KB write full of marker-like characters, fed 3 characters at a time, arrives intact."""
    text = "Writing.\n" + BIG_CALLS[fmt]
    if fmt == "minimax_m2":  # its raw XML values cannot hold a '</parameter' of their own
        text = text.replace("</parameter\n", "\n")
    parser = make_parser(fmt)
    events: list = []
    for i in range(0, len(text), 3):
        events += parser.feed(text[i:i + 3])
    events += parser.finish()
    out = collect(events)
    assert out.errors == [] and len(out.calls) == 1
    expected = BIG.replace("</parameter\n", "\n") if fmt == "minimax_m2" else BIG
    assert out.calls[0].arguments == {"path": "a.py", "content": expected}
    assert out.text == ("Writing.\n" if fmt != "harmony" else "")
