"""The MoE inference engine (``freetoken_agent.runtime``).

Parts, one folder each: ``checkpoint/`` (reading HF folders), ``model/`` (ModelSpec + the generic decoder),
``generation/`` (sampling, stopping), ``tokenizer/`` (tokenizers, chat templates), ``kv/`` (paged KV, radix prefix
cache, sessions), ``experts/`` + ``execution/`` + ``memory.py`` (expert residency under one budget), ``quant/`` +
``kernels/`` (quantized experts); ``engine.py`` is the API. The runtime never imports the SDK, tools or evals.
Public names resolve lazily, so importing this package loads no torch code.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Engine": "freetoken_agent.runtime.engine",
    "SamplingParams": "freetoken_agent.runtime.generation.sampling",
    "Phase": "freetoken_agent.runtime.phase",
    "builtin_model_dir": "freetoken_agent.runtime.builtin",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'freetoken_agent.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
