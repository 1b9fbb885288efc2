"""The benchmark model of ``bench_concurrent``: a random-weight 7.5B ``qwen3_moe``, as a bf16 folder and a GGUF.

24 layers of ``bench_gguf_decode``'s block (hidden 2048, 16 query / 4 KV heads of 128, 64 experts top-8, expert
intermediate 768): 7.54B parameters, 7.25B of them in routed experts. The folder gets the built-in model's
tokenizer files (an 8k byte-level BPE with a Qwen chat template; vocab 8192, the config's), so ``freetoken serve``
renders and tokenizes agent prompts. The GGUF (``bench_gguf_decode.write_gguf``) holds our engine's own Q4_0 expert
blocks byte for byte and the same dense weights; its vocabulary is a filler SentencePiece list of the same size, so
the benchmark sends llama-server the token ids our tokenizer produced (identical prompts on both sides) and never
asks it to tokenize text.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.bench_gguf_decode import CONFIG, ensure_gguf, write_checkpoint

MODEL_CONFIG: dict[str, Any] = {**CONFIG, "num_hidden_layers": 24, "eos_token_id": 2, "max_position_embeddings": 16384}
"""``eos_token_id`` 2 is ``<|im_end|>`` in the built-in tokenizer; 16k positions so the long-context row can decode
after 8,192 tokens (random weights: the position count only bounds the prompt)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def builtin_tokenizer_dir() -> Path:
    from freetoken_agent.runtime.builtin import builtin_model_dir

    return builtin_model_dir()


def prepare_model(folder: Path, config: dict[str, Any] | None = None, dense: str = "none",
                  threads: int = 2) -> tuple[Path, Path]:
    """(the model folder, its GGUF): written once (the GGUF also fills our expert cache file on the way)."""
    write_checkpoint(folder, config=config or MODEL_CONFIG)
    for name in TOKENIZER_FILES:
        if not (folder / name).is_file():
            shutil.copyfile(builtin_tokenizer_dir() / name, folder / name)
    return folder, ensure_gguf(folder, threads=threads, dense=dense)
