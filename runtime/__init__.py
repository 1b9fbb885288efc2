"""The MoE inference engine (``freetoken_agent.runtime``).

Parts, one folder each: ``checkpoint/`` (reading HF folders), ``model/`` (ModelSpec + the generic decoder),
``generation/`` (sampling, stopping), ``tokenizer/`` (tokenizers, chat templates), ``kv/`` (paged KV, radix prefix
cache, sessions), ``experts/`` + ``execution/`` + ``memory.py`` (expert residency under one budget), ``quant/`` +
``kernels/`` (quantized experts); ``engine.py`` is the API. The runtime never imports the SDK, tools or evals.
Public names resolve lazily, so importing this package loads no torch code.
"""

from __future__ import annotations

from freetoken_agent.runtime.lazy import lazy_exports

_LAZY = {
    "Engine": "freetoken_agent.runtime.engine",
    "SamplingParams": "freetoken_agent.runtime.generation.sampling",
    "Phase": "freetoken_agent.runtime.phase",
    "builtin_model_dir": "freetoken_agent.runtime.builtin",
}


__getattr__, __dir__ = lazy_exports('freetoken_agent.runtime', _LAZY, globals())
