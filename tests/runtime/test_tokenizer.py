"""Tokenizers (tokenizer.json and tiktoken vocabularies), streaming detokenization and chat templates."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from freetoken_agent.runtime.errors import TokenizerError
from freetoken_agent.runtime.synthetic import write_tokenizer
from freetoken_agent.runtime.tokenizer import ChatTemplate, IncrementalDecoder, Tokenizer

# A Qwen/Hermes-style template exercising tools, tojson, loop controls and raise_exception.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{% continue %}{% endif %}
{%- if message['role'] not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] or '' }}
{%- for call in message.get('tool_calls', []) %}
<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You fix bugs. Ünïcödé ok."},
    {"role": "user", "content": "Run the tests"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "run_tests", "arguments": {"path": "tests/"}}}]},
    {"role": "tool", "content": "2 passed"},
]
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run pytest",
                                            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    write_tokenizer(tmp_path, 400)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_roundtrip_and_special_tokens(folder: Path) -> None:
    tok = Tokenizer.from_pretrained(folder)
    text = "def f(x):\n    return x * 2  # ünïcödé 🚀"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.special_tokens["<|im_start|>"] and tok.special_tokens["<|im_end|>"] in ids
    assert tok.eos_token_ids == [tok.special_tokens["<|im_end|>"]]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_incremental_decoder_never_splits_characters(folder: Path) -> None:
    tok = Tokenizer.from_pretrained(folder)
    text = "héllo wörld 🚀🚀 — ascii and 中文 mixed " * 3
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.push(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_tiktoken_vocabulary(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"de", b"def", b" f", b"in", b"int"):
        ranks[merge] = len(ranks)
    (tmp_path / "tiktoken.model").write_text(
        "\n".join(f"{base64.b64encode(k).decode()} {v}" for k, v in ranks.items()) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end|>", "added_tokens_decoder": {str(len(ranks)): {"content": "<|end|>", "special": True}}}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.kind == "tiktoken"
    ids = tok.encode("def f(int)<|end|>")
    assert ranks[b"def"] in ids and ids[-1] == len(ranks)
    assert tok.decode(ids) == "def f(int)<|end|>"
    assert tok.eos_token_ids == [len(ranks)]


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_pretrained(tmp_path)


def test_chat_template_matches_transformers(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    template = ChatTemplate.from_pretrained(folder)
    assert template is not None
    for tools in (None, TOOLS):
        for gen in (True, False):
            ours = template.render(MESSAGES, tools=tools, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
    assert '"arguments": {"path": "tests/"}' in ours and "Ünïcödé" in ours


def test_chat_template_errors_are_clear(folder: Path) -> None:
    template = ChatTemplate.from_pretrained(folder)
    assert template is not None
    with pytest.raises(TokenizerError, match="bad role robot"):
        template.render([{"role": "robot", "content": "x"}])
    with pytest.raises(TokenizerError, match="invalid chat template"):
        ChatTemplate("{% for x in %}")


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D{{ messages|length }}"}, {"name": "tool_use", "template": "T"}]}))
    assert ChatTemplate.from_pretrained(tmp_path).render([{"role": "user", "content": "x"}]) == "D1"
    assert ChatTemplate.from_pretrained(tmp_path, name="tool_use").render([]) == "T"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token or '' }}")
    assert ChatTemplate.from_pretrained(tmp_path).render([]) == "J"
