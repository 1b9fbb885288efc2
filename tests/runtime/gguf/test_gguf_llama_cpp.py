"""Our engine against llama.cpp (``llama-cpp-python``) on the same GGUF files: greedy top-1 agreement.

Skipped, with the reason printed (``pytest -rs``), where ``llama-cpp-python`` is not installed; written to run as is
where it is. The trained built-in model is written as GGUF with Q8_0, Q4_0, Q4_K, Q5_K and MXFP4 experts (gate/up
run as stored; down, 112 values a row, is no whole number of blocks and stays F16 in the file); both engines score
the same few hundred positions of a text, and their top-1 predictions must agree on at least 95% of them. Tiny random
GLM-4.5, GPT-OSS (also with MXFP4 experts, the format its GGUF files ship in), DeepSeek and Qwen3-Next checkpoints are
written without a vocabulary (llama.cpp's ``none`` tokenizer) and scored on random token ids the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from freetoken_agent.runtime.builtin import builtin_model_dir
from freetoken_agent.runtime.engine import Engine

from tests.runtime.gguf.models import varied_checkpoint
from tests.runtime.gguf.writer import write_gguf

OVERRIDES = {"deepseek_v2": {"scoring_func": "softmax", "q_lora_rank": 20}, "deepseek_v3": {"scoring_func": "sigmoid"}}
"""DeepSeek: the router config.json names (the tiny configs leave it out; the converter writes it as the gating key);
V2 with a query LoRA: llama.cpp takes a DeepSeek-V2 without one for V2-Lite only by its layer count (26 or 27)."""
SKIP = "llama-cpp-python is not installed: the comparison with llama.cpp on the same GGUF file is skipped"

TEXT = ("def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] <= b[0] else b.pop(0))\n"
        "    return out + a + b\n\nclass Cache:\n    def __init__(self, size):\n        self.size, self.items = size, {}\n"
        "\n    def get(self, key, default=None):\n        return self.items.get(key, default)\n") * 3


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "MXFP4"])
def test_top1_agreement_with_llama_cpp(kind: str, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason=SKIP)
    src = builtin_model_dir()
    file = write_gguf(src, tmp_path / f"b-{kind}.gguf", experts=kind, tokenizer=src)
    ours = Engine.from_pretrained(file)
    assert ours.quant.fmt.split("+")[0] == kind.lower()  # gate/up run in the file's format, as stored
    ids = ours.tokenizer.encode(TEXT)[:300]
    mine = ours.logits(ids).argmax(-1).tolist()
    llm = llama_cpp.Llama(model_path=str(file), n_ctx=512, logits_all=True, verbose=False)
    llm.eval(ids)
    import numpy as np

    theirs = np.asarray(llm.scores[: len(ids)]).argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(mine, theirs)) / len(ids)
    print(f"{kind}: top-1 agreement with llama.cpp {agree:.3f} over {len(ids)} positions")
    assert agree >= 0.95


TINY = [(arch, kind) for kind in ("F32", "Q8_0") for arch in ("glm4_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                                                                 "qwen3_next")] + [("gpt_oss", "MXFP4")]


@pytest.mark.parametrize(("arch", "kind"), TINY)
def test_tiny_top1_agreement_with_llama_cpp(arch: str, kind: str, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason=SKIP)
    import numpy as np
    import torch

    varied_checkpoint(arch, tmp_path / "hf", seed=1, **OVERRIDES.get(arch, {}))
    file = write_gguf(tmp_path / "hf", tmp_path / f"{arch}.gguf", experts=kind, no_vocab=True)
    ids = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = Engine.from_pretrained(file)
    assert kind == "F32" or ours.quant.fmt == kind.lower()  # the experts run as stored
    mine = ours.logits(ids).argmax(-1).tolist()
    llm = llama_cpp.Llama(model_path=str(file), n_ctx=256, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)]).argmax(-1).tolist()
    # GPT-OSS: llama.cpp rounds YaRN's correction range to whole dimensions; transformers' GPT-OSS (which we follow,
    # as trained) does not (``truncate=False``): a few positions differ (0.97-0.98 here, 1.0 with truncation)
    agree = sum(a == b for a, b in zip(mine, theirs)) / len(ids)
    print(f"{arch} {kind}: top-1 agreement with llama.cpp {agree:.3f} over {len(ids)} positions")
    assert agree >= 0.95
