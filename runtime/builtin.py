"""Where the built-in model lives: the default model when no ``--model`` is given.

The built-in model is a tiny ``qwen3_moe`` (about 11.6M parameters, 16 experts, top-2) trained on this
project's machines on real coding-agent sessions and Python source. It speaks the agent format (Hermes/Qwen
chat template, ``<tool_call>`` JSON for a ``bash`` tool) and routes like a trained MoE, but it does not solve
tasks. Its folder is package data of ``freetoken_agent.builtin``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from freetoken_agent.runtime.errors import CheckpointError

BUILTIN_MODEL_NAME = "freetoken-builtin-moe"
"""The name the CLI and server report for the built-in model."""

BUILTIN_SYSTEM_PROMPT = (
    "You are a helpful assistant that can interact multiple times with a computer shell to solve programming tasks.\n"
    "Your response must contain exactly ONE bash code block with ONE command (or commands connected with && or ||).\n"
    "\n"
    "Include a THOUGHT section before your command where you explain your reasoning process.\n"
    "Format your response as shown in <format_example>.\n"
    "\n"
    "<format_example>\n"
    "THOUGHT: Your reasoning and analysis here\n"
    "\n"
    "```bash\n"
    "your_command_here\n"
    "```\n"
    "</format_example>\n"
    "\n"
    "Failure to follow these rules will cause your response to be rejected."
)
"""The system prompt of every training session (mini-swe-agent's, MIT licence). The built-in model answers in
the agent format (THOUGHT text, then a ``<tool_call>`` for the ``bash`` tool) when prompted with it and the
``bash`` tool; with other system prompts its greedy output tends to loop."""

_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def builtin_model_dir() -> Path:
    """The folder of the built-in model (a standard Hugging Face folder), checked to be complete.

    Found through the ``freetoken_agent`` package location without importing any SDK module (the runtime never
    imports the SDK). Raises ``CheckpointError`` with one line when the installation lacks the model files.
    """
    spec = importlib.util.find_spec("freetoken_agent")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        folder = Path(root) / "builtin"
        if all((folder / name).is_file() for name in _REQUIRED):
            return folder
    where = ", ".join(str(Path(r) / "builtin") for r in roots) or "the freetoken_agent package"
    raise CheckpointError(f"the built-in model is missing from {where} (reinstall freetoken-agent, or pass --model)")
