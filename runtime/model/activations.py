"""Activation functions by name: the one home for every name a config's ``hidden_act`` (or ``*_act``) may hold.

The names are transformers' ``ACT2FN`` keys (our oracle), each computed with the same formula so that logits match
to fp32 rounding. Aliases resolve to one canonical name (``swish`` → ``silu``, ``gelu_pytorch_tanh`` →
``gelu_tanh``); the spec stores canonical names. Activations with learned parameters (``prelu``, ``xielu``) keep
per-module weights that no adapter maps, so they are refused with a ``ConfigError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from freetoken_agent.runtime.errors import ConfigError

Fn = Callable[[torch.Tensor], torch.Tensor]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_python(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Fn] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10.0, 10.0),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_new": _gelu_tanh_python,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_python_tanh": _gelu_tanh_python,
    "gelu_accurate": _gelu_tanh_python,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "hardswish": F.hardswish,
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0)))),
    "leaky_relu": F.leaky_relu,  # slope 0.01, as nn.LeakyReLU()
    "linear": lambda x: x,
    "mish": F.mish,
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
}
"""Canonical name → function ([..] → same shape)."""

_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu_squared": "relu2", "squared_relu": "relu2"}
_FUSED = {"swiglu_oai": "silu", "silu_clamp": "silu", "softcap_swiglu": "silu"}
"""Fused forms (set by adapters, never read from a config) whose clamps the MLP / experts apply around a SiLU."""
_LEARNED = ("prelu", "xielu")


def canonical(name: object, field: str = "hidden_act") -> str:
    """The canonical name of a config activation; a ``ConfigError`` naming ``field`` for anything else."""
    if not isinstance(name, str):
        raise ConfigError(f"config field {field!r} must be an activation name, got {name!r}")
    name = _ALIASES.get(name, name)
    if name in ACTIVATIONS:
        return name
    if name in _LEARNED:
        raise ConfigError(f"config field {field!r} = {name!r}: activations with learned parameters are not supported")
    raise ConfigError(f"config field {field!r} = {name!r} is not a known activation; known: "
                      f"{', '.join(sorted([*ACTIVATIONS, *_ALIASES]))}")


def activation_fn(name: str) -> Fn:
    """The function of a canonical (or aliased) activation name; a fused form gives its inner SiLU."""
    return ACTIVATIONS[_FUSED.get(name) or _ALIASES.get(name, name)]
