"""Write the trained model as a standard Hugging Face folder (bf16 weights, tokenizer, chat template)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.evals.builtin.template import CHAT_TEMPLATE
from freetoken_agent.evals.builtin.tokenizer import hf_tokenizer
from tokenizers import Tokenizer

# Files that make up the shipped folder; anything else in ``out`` (an older export's leftovers) is removed.
FOLDER_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "training.json")


def export_folder(model, tokenizer: Tokenizer, out: Path, provenance: dict[str, Any]) -> None:
    """Save ``model`` (cast to bfloat16) and ``tokenizer`` to ``out``; the chat template goes in tokenizer_config.json.

    ``transformers`` 5 would write the template to ``chat_template.jinja``; it is folded into
    ``tokenizer_config.json`` instead (older readers and our engine look there) and the tokenizer class is
    written as ``PreTrainedTokenizerFast`` so that ``transformers`` 4 loads the folder too.
    """
    out.mkdir(parents=True, exist_ok=True)
    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.generation_config.eos_token_id = [2, 0]  # <|im_end|>, <|endoftext|>
    shipped.generation_config.pad_token_id = 0
    shipped.generation_config.bos_token_id = None
    shipped.save_pretrained(out)
    model_config_path = out / "config.json"
    model_config = json.loads(model_config_path.read_text())
    # transformers 5 writes num_experts under its alias num_local_experts; Qwen's own configs (and most readers)
    # use num_experts, so write both.
    model_config["num_experts"] = model_config.get("num_local_experts", model_config.get("num_experts"))
    model_config_path.write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
    hf_tokenizer(tokenizer, CHAT_TEMPLATE).save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
                   "bos_token": None, "add_bos_token": False, "add_eos_token": False})
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(provenance, indent=2) + "\n")
    for path in out.iterdir():
        if path.name not in FOLDER_FILES:
            path.unlink()
