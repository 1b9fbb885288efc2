"""A tiny random qwen3_moe checkpoint with a real tokenizer and a Qwen-style chat template (tools included).

Built in seconds with ``transformers`` and ``tokenizers``; nothing is downloaded. Random weights: the text is
gibberish, which is the point — the machinery must end cleanly within its limits whatever the model writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CORPUS = [
    "def add(a, b):\n    return a + b\n", "The test in test_calc.py fails. Fix the bug.",
    '{"name": "read_file", "arguments": {"path": "calc.py"}}', "You are a careful coding agent.",
    "import os\nimport sys\nfor i in range(10):\n    print(i)\n", "pytest: 1 failed, 0 passed",
]


def build_tiny_qwen3_moe(folder: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``folder``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from freetoken_agent.agent import CODING_INSTRUCTIONS
    from freetoken_agent.tools import ToolRegistry, coding_tools

    folder.mkdir(parents=True, exist_ok=True)
    # trained on the agent's own prompt pieces so prompts stay short (fast prefill in tests)
    corpus = [*CORPUS, CODING_INSTRUCTIONS, QWEN_TEMPLATE,
              *(json.dumps(schema) for schema in ToolRegistry(coding_tools()).schemas())]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 2, trainer)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "add_bos_token": False}))
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=4096, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False, initializer_range=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def shared_tiny_qwen3_moe(factory: Any) -> Path:
    """One checkpoint per pytest session (``factory`` is ``tmp_path_factory``), shared by every module using it."""
    folder = factory.getbasetemp() / "shared-tiny-qwen3-moe"
    if not (folder / "config.json").is_file():
        build_tiny_qwen3_moe(folder)
    return folder
