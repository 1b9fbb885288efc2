"""Every activation name a config may hold computes what transformers' ``ACT2FN`` computes."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.errors import ConfigError
from freetoken_agent.runtime.model.activations import (
    ACTIVATIONS,
    activation_fn,
    canonical,
)

activations = pytest.importorskip("transformers.activations")
LEARNED = {"prelu", "xielu"}


@pytest.mark.parametrize("name", sorted(set(activations.ACT2CLS) - LEARNED))
def test_every_transformers_activation_matches(name: str) -> None:
    x = torch.randn(4, 257) * 4  # wide range: clips (gelu_10, relu6) and tails matter
    got = activation_fn(canonical(name))(x)
    want = activations.ACT2FN[name](x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), name


def test_aliases_resolve_to_one_canonical_name() -> None:
    assert canonical("swish") == "silu" and canonical("gelu_pytorch_tanh") == "gelu_tanh"
    assert set(map(canonical, set(activations.ACT2CLS) - LEARNED)) <= set(ACTIVATIONS)


@pytest.mark.parametrize(("value", "cause"), [("prelu", "learned parameters"), ("xielu", "learned parameters"),
                                              ("gelu_9000", "not a known activation"), (3, "must be an activation")])
def test_unsupported_or_bad_names_raise_a_config_error_naming_the_field(value: object, cause: str) -> None:
    with pytest.raises(ConfigError, match=cause) as err:
        canonical(value, "mlp_hidden_act")
    assert "mlp_hidden_act" in str(err.value)
