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


class NonFiniteWeightError(CheckpointError):
    """A checkpoint tensor holds NaN or infinity (checked at load unless ``FREETOKEN_CHECK_WEIGHTS=0``)."""


class WeightDtypeError(CheckpointError):
    """A checkpoint tensor has a dtype that cannot be right for it (an integer norm weight, a float where packed
    integers belong)."""


class PromptError(FreeTokenError, ValueError):
    """A prompt that can never run: empty, not integer token ids, or ids outside the vocabulary."""


class SamplingError(FreeTokenError, ValueError):
    """A sampling parameter of the wrong type or out of range (NaN temperature, top_p outside (0, 1], ...)."""


class OptionError(FreeTokenError, ValueError):
    """An engine option out of range (threads, dtype, quantization format)."""
