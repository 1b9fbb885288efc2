"""Activation functions by name: the one home for every name a config's ``hidden_act`` (or ``*_act``) may hold.

The names are transformers' ``ACT2FN`` keys (our oracle), each computed with the same formula so that logits match
to fp32 rounding. Aliases resolve to one canonical name (``swish`` → ``silu``, ``gelu_pytorch_tanh`` →
``gelu_tanh``); the spec stores canonical names. Activations with learned parameters (``prelu``, ``xielu``; see
``LEARNED``) compute with the tensors of their site: each place the modeling code builds the activation as a module
(an MLP's ``act_fn``, the experts' ``act_fn``, a mixer's) stores them under that module's name; the loader reads them
into the site's weights as ``act.{param}`` (``params_in``) and the site calls ``activation_fn(name, params)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial

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

Params = Mapping[str, torch.Tensor]
"""A learned activation's tensors by parameter name (``weight``; ``alpha_p``, ``alpha_n``, ``beta``, ``eps``)."""

LEARNED: dict[str, dict[str, tuple[int, ...]]] = {
    "prelu": {"weight": (1,)},
    "xielu": {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()},
}
"""Activations with learned parameters → their tensors' names and shapes, as transformers' modules store them
(``nn.PReLU()``: one slope; ``XIELUActivation``: parameters ``alpha_p``/``alpha_n``, buffers ``beta``/``eps``)."""


def _prelu(x: torch.Tensor, p: Params) -> torch.Tensor:
    return F.prelu(x, p["weight"].to(x.device, x.dtype))


def _xielu(x: torch.Tensor, p: Params) -> torch.Tensor:
    # transformers' torch path (its CUDA kernel is optional). The coefficients are computed in the parameters' own
    # dtype (bf16 as the module creates them), then promoted with x, exactly as the module's operators do.
    # (experts computed on the host while dense weights sit on a GPU: the parameters follow x)
    alpha_p_raw, alpha_n_raw, beta, eps = (p[k].to(x.device) for k in ("alpha_p", "alpha_n", "beta", "eps"))
    alpha_p = F.softplus(alpha_p_raw)
    alpha_n = beta + F.softplus(alpha_n_raw)
    y = torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)
    return y.to(x.dtype)


_LEARNED_FNS: dict[str, Callable[[torch.Tensor, Params], torch.Tensor]] = {"prelu": _prelu, "xielu": _xielu}


def default_params(name: str) -> dict[str, torch.Tensor]:
    """The parameters a freshly built transformers module of learned activation ``name`` holds (``{}`` for the
    others): used where the modeling code builds the module on every call (``ACT2FN[name](x)`` in the recurrent
    mixers' convolutions), so no trained values exist."""
    if name == "prelu":
        return {"weight": torch.full((1,), 0.25)}
    if name == "xielu":  # XIELUActivation() defaults, in its default dtype (bf16), rounded as it rounds them
        bf16 = torch.bfloat16
        return {"alpha_p": torch.log(torch.expm1(torch.tensor(0.8, dtype=bf16))).unsqueeze(0),
                "alpha_n": torch.log(torch.expm1(torch.tensor(0.8 - 0.5, dtype=bf16))).unsqueeze(0),
                "beta": torch.tensor(0.5, dtype=bf16), "eps": torch.tensor(-1e-6, dtype=bf16)}
    return {}


def params_in(weights: Mapping[str, torch.Tensor], key: str = "act") -> dict[str, torch.Tensor]:
    """The activation parameters a loader stored in a site's weight dict as ``{key}.{param}`` (``{}``: none)."""
    start = f"{key}."
    return {k[len(start):]: t for k, t in weights.items() if k.startswith(start)}


def canonical(name: object, field: str = "hidden_act") -> str:
    """The canonical name of a config activation; a ``ConfigError`` naming ``field`` for anything else."""
    if not isinstance(name, str):
        raise ConfigError(f"config field {field!r} must be an activation name, got {name!r}")
    name = _ALIASES.get(name, name)
    if name in ACTIVATIONS or name in LEARNED:
        return name
    raise ConfigError(f"config field {field!r} = {name!r} is not a known activation; known: "
                      f"{', '.join(sorted([*ACTIVATIONS, *LEARNED, *_ALIASES]))}")


def activation_fn(name: str, params: Params | None = None) -> Fn:
    """The function of a canonical (or aliased) activation name; a fused form gives its inner SiLU. A learned
    activation needs the ``params`` of its site (``LEARNED[name]``); a ``ConfigError`` when a site has none."""
    name = _FUSED.get(name) or _ALIASES.get(name, name)
    learned = _LEARNED_FNS.get(name)
    if learned is None:
        return ACTIVATIONS[name]
    missing = [p for p in LEARNED[name] if p not in (params or {})]
    if missing:
        raise ConfigError(f"activation {name!r} has learned parameters, but this site has no {', '.join(missing)}")
    return partial(learned, p=dict(params or {}))
