"""Exceptions the engine raises for bad input. Each message is one clear line for the user."""

from __future__ import annotations


class FreeTokenError(Exception):
    """Base of every error the runtime reports to a user (the CLI prints it as one line)."""


class CheckpointError(FreeTokenError):
    """The model folder cannot be read as a checkpoint."""


class MissingTensorError(CheckpointError):
    """A parameter the architecture needs is not in the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds a tensor the architecture neither uses nor knowingly ignores."""


class ShapeMismatchError(CheckpointError):
    """A checkpoint tensor has a different shape from what the config implies."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file or index cannot be parsed."""


class UnsupportedArchitectureError(FreeTokenError):
    """``config.json`` names a model type the engine has no adapter for."""


class ConfigError(FreeTokenError):
    """``config.json`` is missing, unreadable, or inconsistent."""


class TokenizerError(FreeTokenError):
    """Tokenizer files are missing or unreadable, or a chat template cannot be rendered."""
