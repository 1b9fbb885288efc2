"""Resolve what a user typed as ``--model`` into a model folder.

- nothing, or ``builtin``: the built-in trained model (falls back to ``synthetic:qwen3_moe`` if it is missing);
- ``synthetic:ARCH``: a cached random-weight checkpoint of a preset architecture (written on first use);
- anything else: a path to a Hugging Face model folder, or a GGUF model: a ``.gguf`` file, the first part of a split
  one (``-00001-of-0000N.gguf``) or a folder holding one (``runtime/gguf``), resolved to that file.
"""

from __future__ import annotations

from pathlib import Path

from freetoken_agent.runtime.errors import CheckpointError, ConfigError


def resolve_model(name: str | None) -> Path:
    if name in (None, "", "builtin"):
        from freetoken_agent.runtime.builtin import builtin_model_dir

        try:
            return builtin_model_dir()
        except CheckpointError:
            if name == "builtin":
                raise
            name = "synthetic:qwen3_moe"
    assert name is not None
    if name.startswith("synthetic:"):
        from freetoken_agent.runtime.synthetic import synthetic_model_dir

        return synthetic_model_dir(name.split(":", 1)[1])
    path = Path(name).expanduser()
    if not path.exists():
        kind = "model file" if path.suffix.lower() == ".gguf" else "model folder"
        raise ConfigError(f"{kind} not found: {path}")
    from freetoken_agent.runtime.gguf import find_gguf, is_gguf

    if is_gguf(path):
        return find_gguf(path)  # the file (first part) to load; a later part or several models: one clear error
    return path


def is_synthetic(path: Path) -> bool:
    """True for checkpoints written by ``runtime.synthetic`` (random weights)."""
    try:
        import json

        return json.loads((path / "config.json").read_text()).get("synthetic") is not None
    except (OSError, ValueError):
        return False
