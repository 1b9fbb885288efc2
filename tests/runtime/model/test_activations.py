"""Every activation name a config may hold computes what transformers' ``ACT2FN`` computes."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.errors import ConfigError
from freetoken_agent.runtime.model.activations import (
    ACTIVATIONS,
    LEARNED,
    activation_fn,
    canonical,
    default_params,
)

activations = pytest.importorskip("transformers.activations")


@pytest.mark.parametrize("name", sorted(set(activations.ACT2CLS) - set(LEARNED)))
def test_every_transformers_activation_matches(name: str) -> None:
    x = torch.randn(4, 257) * 4  # wide range: clips (gelu_10, relu6) and tails matter
    got = activation_fn(canonical(name))(x)
    want = activations.ACT2FN[name](x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), name


def test_aliases_resolve_to_one_canonical_name() -> None:
    assert canonical("swish") == "silu" and canonical("gelu_pytorch_tanh") == "gelu_tanh"
    assert set(map(canonical, set(activations.ACT2CLS) - set(LEARNED))) <= set(ACTIVATIONS)


@pytest.mark.parametrize(("value", "cause"), [("gelu_9000", "not a known activation"), (3, "must be an activation")])
def test_unsupported_or_bad_names_raise_a_config_error_naming_the_field(value: object, cause: str) -> None:
    with pytest.raises(ConfigError, match=cause) as err:
        canonical(value, "mlp_hidden_act")
    assert "mlp_hidden_act" in str(err.value)


@pytest.mark.parametrize("name", sorted(LEARNED))
def test_learned_activations_match_transformers_modules(name: str) -> None:
    module = activations.ACT2FN[name]  # a fresh module, as a model's act_fn
    stored = module.state_dict()  # parameters and buffers: what a checkpoint holds under the module's name
    assert {k: tuple(t.shape) for k, t in stored.items()} == LEARNED[name]
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # trained values, not the init
    x = torch.randn(4, 257) * 4  # both signs: xIELU's two branches, PReLU's slope
    with torch.no_grad():
        want = module(x)
    got = activation_fn(canonical(name), module.state_dict())(x)
    assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("name", sorted(LEARNED))
def test_default_parameters_are_those_of_a_fresh_module(name: str) -> None:
    fresh = activations.ACT2FN[name].state_dict()  # what ACT2FN[name](x), built on every call, computes with
    ours = default_params(name)
    assert ours.keys() == fresh.keys()
    assert all(ours[k].dtype == fresh[k].dtype and torch.equal(ours[k], fresh[k]) for k in fresh)


def test_a_learned_activation_without_its_parameters_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'xielu'.*alpha_p"):
        activation_fn("xielu", {"weight": torch.ones(1)})
    with pytest.raises(ConfigError, match="'prelu'.*weight"):
        activation_fn("prelu")
    assert default_params("silu") == {} and activation_fn("silu", None) is ACTIVATIONS["silu"]


# Sites the loader reads learned activation tensors from, end to end against transformers (the fuzzer's check):
# experts + dense MLP + Mamba convolution (its stored ``act`` unread), lightning attention's act_fn, Doge's one
# act_fn for MLP and experts, DBRX's experts.mlp.activation_fn, Qwen3-Next's shared expert + Gated DeltaNet.
END_TO_END = [("jamba", "xielu"), ("minimax", "prelu"), ("doge", "xielu"), ("dbrx", "prelu"), ("qwen3_next", "xielu")]


@pytest.mark.parametrize(("model_type", "act"), END_TO_END)
def test_learned_activations_match_transformers_end_to_end(model_type: str, act: str) -> None:
    pytest.importorskip("transformers")
    from freetoken_agent.evals.fuzz.options import check
    from freetoken_agent.evals.fuzz.variants import variants

    torch.set_num_threads(1)
    variant = next(v for v in variants(model_type, ("act",)) if v.value == act)
    outcome = check(variant)
    assert outcome.status == "pass", outcome.reason


def test_a_zero_width_shared_expert_leaves_its_activation_parameters_unread() -> None:
    pytest.importorskip("transformers")
    from freetoken_agent.evals.fuzz.options import check
    from freetoken_agent.evals.fuzz.variants import Variant

    torch.set_num_threads(1)
    overrides = {"shared_expert_intermediate_size": 0, "hidden_act": "prelu"}  # the shared act_fn acts on nothing
    outcome = check(Variant("qwen2_moe", "shared", "shared_expert_intermediate_size", "0, prelu", overrides))
    assert outcome.status == "pass", outcome.reason
