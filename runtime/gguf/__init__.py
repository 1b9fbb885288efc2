"""Run GGUF files (llama.cpp's format) as they are: one file, a split file's first part, or a folder holding one.

``file`` finds and opens the parts (the ``gguf`` package's memory-mapped reader) and names every way a file can be
bad; ``arch`` maps the metadata onto the Hugging Face config of the same model and GGUF tensor names onto Hugging
Face names, so the family adapters load it unchanged; ``reader`` serves the tensors under those names (dequantized on
read); ``model`` puts Q8_0 / Q4_0 / Q4_K / Q6_K experts into the kernels as stored and converts other block types at
load; ``tokenizer`` builds the tokenizer and chat template from the metadata.
"""

from __future__ import annotations

from pathlib import Path

from freetoken_agent.runtime.gguf.file import (
    GGUFArchitectureError,
    GGUFError,
    GGUFFile,
    GGUFMetadataError,
    GGUFTensorTypeError,
    find_gguf,
    is_gguf,
)

__all__ = ["GGUFArchitectureError", "GGUFError", "GGUFFile", "GGUFMetadataError", "GGUFTensorTypeError", "find_gguf",
           "is_gguf", "open_gguf"]


def open_gguf(path: str | Path):  # -> GGUFModel | None
    """The ``GGUFModel`` at ``path`` when it names a GGUF model (file, first part, folder holding one), else None."""
    if not is_gguf(path):
        return None
    from freetoken_agent.runtime.gguf.model import GGUFModel

    return GGUFModel(path)
