"""Forced-call grammars in every tool-call format: what each family's template really writes is accepted, wrong
calls are rejected, and a random-weight tiny model sampled under the grammar always writes calls its family's
parser reads back into schema-valid arguments."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

llguidance = pytest.importorskip("llguidance")

from freetoken_agent.chat import collect, make_parser  # noqa: E402
from freetoken_agent.chat.grammar import CONSTRAINED_FORMATS, END_MARKERS, avoiding, tool_call_lark  # noqa: E402
from freetoken_agent.runtime.generation.constraints import JSON_STYLE  # noqa: E402
from tests.sdk.chat.test_templates import CALLS, CASES, TOOLS  # noqa: E402

# the markers each family's tokenizer has as single added tokens (special ones in brackets are special)
MARKERS: dict[str, list[str]] = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "qwen3_coder": ["<tool_call>", "</tool_call>"],
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>"],
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]"],
    "harmony": ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"],
}
CORPUS = ['{"name": "write_file", "arguments": {"path": "a.py"}}', "<parameter=path>\nsrc/calc.py\n</parameter>",
          "def f(x):\n    return x + 1\n", "commentary to=functions.run json", '<invoke name="run">']


def tokenizer_file(folder: Path, fmt: str) -> Path:
    """A small byte-level BPE tokenizer.json with ``fmt``'s markers as added tokens; the first one (id 0) is EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 2, trainer)
    tok.add_tokens([AddedToken(m, special=m.startswith(("<|", "<｜", "[")), normalized=False)
                    for m in MARKERS[fmt]])
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Per format: (llguidance tokenizer, tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer

    out = {}
    for fmt in CONSTRAINED_FORMATS:
        path = tokenizer_file(tmp_path_factory.mktemp(fmt), fmt)
        out[fmt] = (llguidance.LLTokenizer(str(path), eos_token=0), Tokenizer.from_file(str(path)))
    return out


def grammar(fmt: str, tokenizers: dict, tools: list, parallel: bool = True, name: str | None = None) -> str:
    hf = tokenizers[fmt][1]
    return llguidance.LLMatcher.grammar_from_lark(tool_call_lark(fmt, tools, name, parallel, hf.token_to_id,
                                                                 JSON_STYLE))


def accepts(fmt: str, tokenizers: dict, lark: str, text: str) -> bool:
    ll = tokenizers[fmt][0]
    matcher = llguidance.LLMatcher(ll, lark, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(ll.tokenize_str(text, parse_special=True)) and matcher.is_accepting()


def generated_part(fmt: str, rendered: str) -> str:
    """The part of a rendered assistant turn a constrained generation writes: from the first call marker (harmony:
    after the first ``<|start|>assistant``) to the last call's end."""
    start = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "glm45": "<tool_call>",
             "deepseek": "<｜tool▁calls▁begin｜>", "kimi_k2": "<|tool_calls_section_begin|>",
             "minimax_m2": "<minimax:tool_call>", "mistral": "[TOOL_CALLS]"}.get(fmt)
    if start is None:
        first = rendered.index("<|start|>assistant<|channel|>commentary")
        return rendered[first + len("<|start|>assistant"):]
    end = {"mistral": "</s>"}.get(fmt)
    text = rendered[rendered.index(start):]
    if end:
        return text[: text.index(end)]
    last = {"hermes": "</tool_call>", "qwen3_coder": "</tool_call>", "glm45": "</tool_call>",
            "deepseek": "<｜tool▁calls▁end｜>", "kimi_k2": "<|tool_calls_section_end|>",
            "minimax_m2": "</minimax:tool_call>"}[fmt]
    return text[: text.rindex(last) + len(last)]


def parse(fmt: str, text: str, tools: list) -> list[tuple[str, dict]]:
    parser = make_parser(fmt, tools)
    out = collect([*parser.feed(text), *parser.finish()])
    assert out.errors == [], (fmt, text, out.errors)
    return [(c.name, c.arguments) for c in out.calls]


# --------------------------------------------------------------------------------- the avoiding regex
def test_avoiding_matches_exactly_the_texts_without_a_marker() -> None:
    rng = random.Random(0)
    for words in END_MARKERS.values():
        if not words:
            continue
        regex = re.compile(avoiding(words))
        alphabet = "".join(sorted(set("".join(words)))) + "ab\n"
        for _ in range(3000):
            parts = [rng.choice([rng.choice(words)[: rng.randint(0, 12)], rng.choice(alphabet)])
                     for _ in range(rng.randint(0, 6))]
            text = "".join(parts)
            assert bool(regex.fullmatch(text)) == (not any(w in text for w in words)), (words, text)


# -------------------------------------------------------------------- what the templates write is accepted
TEMPLATE_TOOLS = [{"type": "function", "function": {**t["function"], "parameters": {
    **t["function"]["parameters"], "required": list(t["function"]["parameters"]["properties"])}}} for t in TOOLS]


@pytest.mark.parametrize(("fmt", "template"), CASES, ids=[f"{f}-{i}" for i, (f, _t) in enumerate(CASES)])
def test_template_output_is_accepted(fmt: str, template: str, tokenizers: dict) -> None:
    text = render(fmt, CALLS, TOOLS, template)
    assert parse(fmt, text, TOOLS) == CALLS
    assert accepts(fmt, tokenizers, grammar(fmt, tokenizers, TEMPLATE_TOOLS), text), (fmt, text)
    # one call only without parallel calls; a grammar naming the other tool refuses the first call
    assert not accepts(fmt, tokenizers, grammar(fmt, tokenizers, TEMPLATE_TOOLS, parallel=False), text)
    assert not accepts(fmt, tokenizers, grammar(fmt, tokenizers, TEMPLATE_TOOLS, name="run_shell"), text)


# ---------------------------------------------------------------------------- wrong calls are rejected
STRICT = [{"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}, "line": {"type": "integer"},
                                     "force": {"type": "boolean"}},
    "required": ["path", "line"], "additionalProperties": False}}}]
GOOD = {"path": "a.py", "line": 3, "force": True}
WRONG = {"wrong name": ("edot", {"path": "a.py", "line": 3}), "missing required": ("edit", {"path": "a.py"}),
         "wrong type": ("edit", {"path": "a.py", "line": "three"}),
         "extra property": ("edit", {"path": "a.py", "line": 3, "extra": 1}),
         "too long": ("edit", {"path": "a_very_long_path.py", "line": 3})}


def render(fmt: str, calls: list[tuple[str, dict]], tools: list, template: str | None = None) -> str:
    """The generated part of an assistant turn making ``calls``, as ``fmt``'s template writes it."""
    from freetoken_agent.backends.local import template_messages
    from freetoken_agent.runtime.tokenizer.chat import ChatTemplate

    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(calls)]}
    rendered = ChatTemplate(template or dict(CASES)[fmt]).render(template_messages([message]), tools,
                                                                 add_generation_prompt=False)
    return generated_part(fmt, rendered)


def write(fmt: str, name: str, args: dict) -> str:
    """One call as ``fmt``'s template writes it."""
    return render(fmt, [(name, args)], STRICT)


@pytest.mark.parametrize("fmt", CONSTRAINED_FORMATS)
def test_wrong_calls_are_rejected(fmt: str, tokenizers: dict) -> None:
    lark = grammar(fmt, tokenizers, STRICT, parallel=False)
    good = write(fmt, "edit", GOOD)
    assert parse(fmt, good, STRICT) == [("edit", GOOD)]
    assert accepts(fmt, tokenizers, lark, good), good
    for why, (name, args) in WRONG.items():
        assert not accepts(fmt, tokenizers, lark, write(fmt, name, args)), (fmt, why)


def test_xml_values_follow_the_parsers_conversion(tokenizers: dict) -> None:
    """A union-typed string cannot be text the parser would read as another type; enum values are literal."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "tag": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "mode": {"enum": ["fast", "slow", 3]}}, "required": ["tag", "mode"]}}}]
    lark = grammar("qwen3_coder", tokenizers, tools, parallel=False)

    def text(tag: str, mode: str) -> str:
        return (f"<tool_call>\n<function=pick>\n<parameter=tag>\n{tag}\n</parameter>\n<parameter=mode>\n{mode}\n"
                "</parameter>\n</function>\n</tool_call>")

    for tag, mode in [("abc", "fast"), ("null", "slow"), ("x y", "3")]:
        assert accepts("qwen3_coder", tokenizers, lark, text(tag, mode)), (tag, mode)
        jsonschema.validate(dict(parse("qwen3_coder", text(tag, mode), tools))["pick"],
                            tools[0]["function"]["parameters"])
    for tag, mode in [("12", "fast"), ("true", "fast"), (" a", "fast"), ("abc", "medium"), ("abc", '"fast"'),
                      ("a</parameter>", "fast"), ("[1]", "fast"), ("much too long", "fast")]:
        assert not accepts("qwen3_coder", tokenizers, lark, text(tag, mode)), (tag, mode)


def test_unconstrainable_schemas_are_refused_by_name(tokenizers: dict) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}}}]
    with pytest.raises(ValueError, match="'minProperties'"):
        tool_call_lark("glm45", tools, None, False, lambda _t: None, JSON_STYLE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^a|b$"}}}}}]
    with pytest.raises(ValueError, match="parameter 'a'.*pattern"):
        tool_call_lark("minimax_m2", tools, None, False, lambda _t: None, JSON_STYLE)
    # the same schema in a JSON-argument format is fine
    grammar("hermes", tokenizers, tools)
    with pytest.raises(ValueError, match="not among"):
        tool_call_lark("kimi_k2", tools, "g", False, lambda _t: None, JSON_STYLE)


# ------------------------------------------------------------------- end to end: a random tiny model
E2E_TOOLS = [
    {"type": "function", "function": {"name": "edit_line", "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 6}, "line": {"type": "integer", "minimum": 1, "maximum": 99},
        "mode": {"enum": ["insert", "replace"]}, "dry": {"type": "boolean"}},
        "required": ["path", "line", "mode"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "k": {"type": ["string", "null"], "maxLength": 4}, "n": {"type": "number", "minimum": 0, "maximum": 9}},
        "required": ["k"], "additionalProperties": False}}},
]
SEEDS = range(4)


def tiny_model(folder: Path, fmt: str) -> Path:
    """A random-weight tiny qwen3_moe checkpoint whose tokenizer has ``fmt``'s markers and whose chat template is
    that family's (so the engine detects the format from it)."""
    import torch
    import transformers

    tokenizer_file(folder, fmt)
    eos = "<|call|>" if fmt == "harmony" else "<|endoftext|>"
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(eos)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": dict(CASES)[fmt], "eos_token": eos,
                                                              "bos_token": None, "add_bos_token": False}))
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=640, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=1024, eos_token_id=eos_id, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False, initializer_range=0.5)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt", CONSTRAINED_FORMATS)
def test_a_random_model_always_writes_schema_valid_calls(fmt: str, tmp_path: Path) -> None:
    import torch

    from freetoken_agent.backends.base import Constraint, GenerateRequest, GenerationDone, TextChunk
    from freetoken_agent.backends.local import LocalEngine

    torch.set_num_threads(1)
    backend = LocalEngine.from_pretrained(tiny_model(tmp_path / fmt, fmt))
    assert backend.tool_format == fmt
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in E2E_TOOLS}
    prompt = "<|start|>assistant" if fmt == "harmony" else "Call a tool.\n"

    async def sample(seed: int, parallel: bool) -> tuple[str, str]:
        request = GenerateRequest(prompt=prompt, tools=E2E_TOOLS, max_tokens=160, temperature=1.0, seed=seed,
                                  constraint=Constraint("tool_call", parallel=parallel))
        text, finish = [], ""
        async for item in backend.stream_text(request):
            if isinstance(item, TextChunk):
                text.append(item.text)
            elif isinstance(item, GenerationDone):
                finish = item.finish_reason
        return "".join(text), finish

    for seed in SEEDS:  # even seeds: one call; odd: parallel calls (a random model may go on until max_tokens)
        parallel = seed % 2 == 1
        text, finish = asyncio.run(sample(seed, parallel))
        parser = make_parser(fmt, E2E_TOOLS)
        out = collect([*parser.feed(text), *parser.finish()])
        calls = out.calls
        if parallel and finish == "length":  # the call cut by max_tokens is unreadable or partly read
            assert len(out.errors) <= 1, (fmt, seed, text, out.errors)
            calls = calls if out.errors else calls[:-1]
        else:
            assert finish == "stop" and out.errors == [], (fmt, seed, finish, text, out.errors)
            assert parallel or len(out.calls) == 1, (fmt, seed, text)
        assert calls, (fmt, seed, text)
        for call in calls:
            jsonschema.validate(call.arguments, schemas[call.name])
