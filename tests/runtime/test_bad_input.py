"""The bad-input matrix: model folder, config values, weights, prompt and sampling each end in one named error whose
message names the cause — never a traceback from deep inside, never silent garbage. (CLI flags: tests/cli/
test_bad_flags.py; the original cases — missing/unexpected/mis-shaped tensors, corrupt headers, tokenizer files —
stay in test_errors.py.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.runtime.checkpoint.reader import checkpoint_files
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NonFiniteWeightError,
    OptionError,
    PromptError,
    SamplingError,
    WeightDtypeError,
)
from freetoken_agent.runtime.generation.sampling import NumericalError, Sampler, SamplingParams
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.scheduler import ContextLengthError
from freetoken_agent.runtime.synthetic import write_synthetic
from freetoken_agent.runtime.threads import configure_threads

VOCAB, CONTEXT = 300, 48
NORM = "model.layers.0.post_attention_layernorm.weight"
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_synthetic("qwen3_moe", tmp_path_factory.mktemp("bad") / "m", num_hidden_layers=2, hidden_size=64,
                             head_dim=16, num_experts=4, moe_intermediate_size=32, vocab_size=VOCAB,
                             max_position_embeddings=CONTEXT)
    _write_config(folder, {k: v for k, v in _config(folder).items() if k != "synthetic"})
    return folder


@pytest.fixture()
def folder(base: Path, tmp_path: Path) -> Path:
    """A private copy of the model folder that a test may damage."""
    return Path(shutil.copytree(base, tmp_path / "m"))


@pytest.fixture(scope="module")
def engine(base: Path) -> Iterator[Engine]:
    eng = Engine.from_pretrained(base)
    yield eng
    eng.close()


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _write_config(folder: Path, cfg: Any) -> None:
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, fn: Any, file: str = "model.safetensors") -> None:
    tensors = load_file(str(folder / file))
    fn(tensors)
    save_file(tensors, str(folder / file))


def _shard(folder: Path) -> list[str]:
    """Split model.safetensors into two shards (no index yet); returns the shard names."""
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for shard, part in zip(shards, (names[:half], names[half:])):
        save_file({n: tensors[n] for n in part}, str(folder / shard))
    (folder / "model.safetensors").unlink()
    (folder / ".weight_map.json").write_text(json.dumps({n: shards[i >= half] for i, n in enumerate(names)}))
    return shards


def _write_index(folder: Path, weight_map: Any) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ----------------------------------------------------------------------------------------------- model folder


def test_folder_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model folder not found"):
        Engine.from_pretrained(tmp_path / "nope")


def test_file_instead_of_folder(folder: Path) -> None:
    with pytest.raises(ConfigError, match="model.safetensors is a file; give the model folder"):
        Engine.from_pretrained(folder / "model.safetensors")


def test_no_weights_names_what_was_expected(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        Engine.from_pretrained(folder)


def test_shards_without_index_refused_like_transformers(folder: Path) -> None:
    _shard(folder)
    with pytest.raises(CheckpointError,
                       match=r"model-00001-of-00002\.safetensors.*needs its model\.safetensors\.index"):
        Engine.from_pretrained(folder)


def test_pytorch_bin_only_says_convert(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: convert it to safetensors"):
        Engine.from_pretrained(folder)


def test_extra_safetensors_beside_the_model_are_ignored(folder: Path, engine: Engine) -> None:
    """A consolidated copy or an adapter next to model.safetensors is not read (it used to fail the load)."""
    save_file({"lora_A.weight": torch.zeros(2, 2), NORM: torch.zeros(64)}, str(folder / "adapter_model.safetensors"))
    shutil.copy(folder / "model.safetensors", folder / "consolidated.safetensors")  # every name duplicated
    assert checkpoint_files(folder) == [folder / "model.safetensors"]
    loaded = Engine.from_pretrained(folder)
    ids = [5, 6, 7]
    assert torch.equal(loaded.logits(ids), engine.logits(ids))
    loaded.close()


def test_index_and_shards_load_and_ignore_extras(folder: Path, engine: Engine) -> None:
    shards = _shard(folder)
    _write_index(folder, json.loads((folder / ".weight_map.json").read_text()))
    save_file({"junk": torch.zeros(1)}, str(folder / "consolidated.safetensors"))
    assert checkpoint_files(folder) == [folder / s for s in shards]
    loaded = Engine.from_pretrained(folder)
    assert torch.equal(loaded.logits([1, 2]), engine.logits([1, 2]))
    loaded.close()


def test_single_file_wins_over_index_like_transformers(folder: Path) -> None:
    _write_index(folder, {"x": "missing-shard.safetensors"})  # would fail if it were read
    assert checkpoint_files(folder) == [folder / "model.safetensors"]


def test_index_names_a_missing_shard(folder: Path) -> None:
    shards = _shard(folder)
    _write_index(folder, json.loads((folder / ".weight_map.json").read_text()))
    (folder / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shards[1]}"):
        Engine.from_pretrained(folder)


@pytest.mark.parametrize("weight_map, cls, needle", [
    ({}, CorruptCheckpointError, "weight_map is empty"),
    ({"a": 3}, CorruptCheckpointError, "weight_map must map tensor names to shard file names"),
    ({"a": "../outside.safetensors"}, CheckpointError, "outside the model folder"),
    (["model-1.safetensors"], CorruptCheckpointError, "weight_map must map"),
])
def test_bad_index(folder: Path, weight_map: Any, cls: type[Exception], needle: str) -> None:
    (folder / "model.safetensors").unlink()
    _write_index(folder, weight_map)
    with pytest.raises(cls, match=needle):
        Engine.from_pretrained(folder)


def test_index_not_json(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text("{weight_map: oops")
    with pytest.raises(CorruptCheckpointError, match="cannot read the shard index"):
        Engine.from_pretrained(folder)


def test_transformers_weights_chooses_the_file(folder: Path, engine: Engine) -> None:
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    _write_config(folder, {**_config(folder), "transformers_weights": "weights.safetensors"})
    loaded = Engine.from_pretrained(folder)
    assert torch.equal(loaded.logits([9]), engine.logits([9]))
    loaded.close()


@pytest.mark.parametrize("name, cls, needle", [
    ("weights.bin", ConfigError, "transformers_weights must name a .safetensors"),
    ("absent.safetensors", CheckpointError, "transformers_weights 'absent.safetensors'"),
    ("../escape.safetensors", CheckpointError, "outside the model folder"),
])
def test_bad_transformers_weights(folder: Path, name: str, cls: type[Exception], needle: str) -> None:
    _write_config(folder, {**_config(folder), "transformers_weights": name})
    with pytest.raises(cls, match=needle):
        Engine.from_pretrained(folder)


def test_truncated_file(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        Engine.from_pretrained(folder)


def test_duplicate_tensor_across_shards(folder: Path) -> None:
    shards = _shard(folder)
    weight_map = json.loads((folder / ".weight_map.json").read_text())
    _write_index(folder, weight_map)
    first = next(n for n, s in weight_map.items() if s == shards[0])
    _edit_tensors(folder, lambda t: t.__setitem__(first, torch.zeros(1)), shards[1])
    with pytest.raises(CorruptCheckpointError, match=f"{first}.*appears in both"):
        Engine.from_pretrained(folder)


@pytest.mark.parametrize("text, needle", [("[1, 2, 3]", "must hold a JSON object"), ("{oops", "cannot parse"),
                                          ('"qwen3_moe"', "must hold a JSON object")])
def test_config_json_not_an_object(folder: Path, text: str, needle: str) -> None:
    (folder / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=needle):
        Engine.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------- config values

NAN, INF = float("nan"), float("inf")
CONFIG_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("model_type", {"model_type": ["qwen3_moe"]}, r"model_type must be a string, got \['qwen3_moe'\]"),
    ("model_type", {"model_type": 3}, "model_type must be a string"),
    ("hidden_size", {"hidden_size": 256.5}, "hidden_size must be an integer ≥ 1, got 256.5"),
    ("hidden_size", {"hidden_size": "64"}, "hidden_size must be an integer"),
    ("hidden_size", {"hidden_size": 0}, "hidden_size must be an integer ≥ 1, got 0"),
    ("vocab_size", {"vocab_size": -5}, "vocab_size must be an integer ≥ 1"),
    ("num_hidden_layers", {"num_hidden_layers": True}, "num_hidden_layers must be an integer ≥ 1, got true"),
    ("max_position_embeddings", {"max_position_embeddings": 0}, "max_position_embeddings must be"),
    ("top-k 0", {"num_experts_per_tok": 0}, "num_experts_per_tok must be an integer ≥ 1"),
    ("top-k > experts", {"num_experts_per_tok": 5},
     r"num_experts_per_tok \(5\) must not exceed the number of experts \(num_experts = 4\)"),
    ("per-layer top-k", {"num_experts_per_tok": [2, 9]}, r"num_experts_per_tok \(\[2, 9\]\) must not exceed"),
    ("per-layer top-k item", {"num_experts_per_tok": [2, 1.5]}, "num_experts_per_tok item 1 must be an integer"),
    ("num_experts", {"num_experts": -1}, "num_experts must be an integer ≥ 0"),
    ("eps negative", {"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number > 0"),
    ("eps zero", {"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0.*, got 0$"),
    ("eps nan", {"rms_norm_eps": NAN}, "rms_norm_eps must be a finite number > 0.*, got nan"),
    ("heads", {"num_key_value_heads": 3},
     r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("head_dim", {"head_dim": 0}, "head_dim must be an integer ≥ 1"),
    ("rope_theta", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_parameters.rope_theta must be a finite number > 0"),
    ("rope_theta inf", {"rope_parameters": {"rope_type": "default", "rope_theta": INF}},
     "rope_parameters.rope_theta must be a finite number > 0.*, got inf"),
    ("rope factor", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}},
     "rope_parameters.factor must be a finite number > 0"),
    ("rope per layer type", {"rope_parameters": {"full_attention": {"rope_type": 7, "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type must be a string"),
    ("rope_scaling list", {"rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ("partial_rotary_factor", {"partial_rotary_factor": 1.5},
     r"partial_rotary_factor must be a finite number in \(0, 1\]"),
    ("tie_word_embeddings", {"tie_word_embeddings": "false"},
     "tie_word_embeddings must be true or false.*, got 'false'"),
    ("hidden_act", {"hidden_act": 5}, "hidden_act must be a string"),
    ("layer_types", {"layer_types": ["full_attention"]}, "layer_types has 1 entries but num_hidden_layers is 2"),
    ("mlp_only_layers", {"mlp_only_layers": [-1]}, "mlp_only_layers item 0 must be an integer ≥ 0"),
    ("sliding_window", {"sliding_window": -5}, "sliding_window must be an integer ≥ 0"),
    ("sliding window used but 0", {"use_sliding_window": True, "sliding_window": 0},
     "use_sliding_window is true but sliding_window is 0"),
    ("eos_token_id", {"eos_token_id": "2"}, "eos_token_id must be an integer"),
    ("decoder_sparse_step", {"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer ≥ 1"),
    ("text_config", {"text_config": {"hidden_size": 1.5}}, r"\(text_config\): hidden_size must be an integer"),
]


@pytest.mark.parametrize("case, change, needle", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_value(base: Path, case: str, change: dict[str, Any], needle: str) -> None:
    cfg = json.loads(json.dumps({**_config(base), **change}))  # as it would come from config.json
    with pytest.raises(ConfigError, match=needle):
        spec_from_config(cfg)


def test_missing_required_field_is_named(base: Path) -> None:
    cfg = {k: v for k, v in _config(base).items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="missing the field 'num_experts'"):
        spec_from_config(cfg)


@pytest.mark.parametrize("change, needle", [
    ({"n_group": 3}, r"n_routed_experts \(16\) must be divisible by n_group \(3\)"),
    ({"topk_group": 5}, r"topk_group \(5\) must not exceed n_group \(4\)"),
])
def test_bad_group_routing(change: dict[str, Any], needle: str) -> None:
    from freetoken_agent.runtime.synthetic import _BASE, PRESETS

    with pytest.raises(ConfigError, match=needle):
        spec_from_config({**_BASE, **PRESETS["deepseek_v3"], **change})


def test_bad_config_through_the_engine(folder: Path) -> None:
    """config.json as written on disk (NaN and Infinity are what Python's json writes for them)."""
    _write_config(folder, {**_config(folder), "rms_norm_eps": NAN})
    assert "NaN" in (folder / "config.json").read_text()
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        Engine.from_pretrained(folder)


def test_every_transformers_config_passes_validation() -> None:
    """The rules refuse nothing transformers builds (its default and tiny config of every supported MoE type) and
    no published config (the fixtures of test_published_configs.py)."""
    transformers = pytest.importorskip("transformers")
    from freetoken_agent.runtime.model.adapters import supported_architectures
    from freetoken_agent.runtime.model.validate import validate_config
    from tests.runtime.arch_configs import make_config, moe_causal_lm_types

    checked = 0
    for model_type in moe_causal_lm_types():
        if model_type not in supported_architectures():
            continue
        for cfg in (transformers.AutoConfig.for_model(model_type), make_config(model_type)):
            validate_config(json.loads(json.dumps(cfg.to_dict())))
            checked += 1
    assert checked >= 100
    for fixture in sorted((Path(__file__).parent / "published_configs").glob("*.json")):  # hub config.json key sets
        validate_config(json.loads(fixture.read_text()), fixture.name)


# ----------------------------------------------------------------------------------------------- weights


def test_nan_norm_weight_refused_naming_the_tensor(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t[NORM].__setitem__(3, NAN))
    with pytest.raises(NonFiniteWeightError, match=rf"tensor '{NORM}' holds 1 NaN and 0 infinite"):
        Engine.from_pretrained(folder)


def test_inf_expert_weight_refused(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t[EXPERT].__setitem__((0, 0), -INF))
    with pytest.raises(NonFiniteWeightError, match=rf"'{EXPERT}' holds 0 NaN and 1 infinite"):
        Engine.from_pretrained(folder)


def test_nan_in_bf16_embedding_refused(folder: Path) -> None:
    def damage(t: dict[str, torch.Tensor]) -> None:
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].bfloat16()
        t["model.embed_tokens.weight"][7, 7] = NAN

    _edit_tensors(folder, damage)
    with pytest.raises(NonFiniteWeightError, match="model.embed_tokens.weight"):
        Engine.from_pretrained(folder)


def test_unchecked_nan_weights_fail_at_sampling_not_silently(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the check off (trusted caches), NaN that reaches the logits is a NumericalError, greedy included."""
    _edit_tensors(folder, lambda t: t["model.norm.weight"].__setitem__(0, NAN))
    monkeypatch.setenv("FREETOKEN_CHECK_WEIGHTS", "0")
    loaded = Engine.from_pretrained(folder)
    for temperature in (0.0, 0.7):
        with pytest.raises(NumericalError, match="NaN logits"):
            loaded.generate([1, 2, 3], max_new_tokens=2, temperature=temperature)
    loaded.close()


@pytest.mark.parametrize("name, dtype", [(NORM, torch.int16), (EXPERT, torch.int32),
                                         ("lm_head.weight", torch.uint8)])
def test_integer_weight_refused(folder: Path, name: str, dtype: torch.dtype) -> None:
    _edit_tensors(folder, lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(WeightDtypeError, match=rf"tensor '{name}'.* is stored as {str(dtype)[6:]}"):
        Engine.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------- prompt


@pytest.mark.parametrize("ids, needle", [
    ([1, 2**70], f"token id {2**70} is outside the vocabulary"),
    ([-1], "token id -1 is outside the vocabulary"),
    ([VOCAB], f"token id {VOCAB} is outside the vocabulary \\(size {VOCAB}\\)"),
    ([], "the prompt is empty"),
    ([1, 1.5], "position 1 must be an integer, got 1.5"),
    ([True, 2], "position 0 must be an integer, got True"),
    (["3"], "position 0 must be an integer, got '3'"),
    ("hello", "must be a list of integers, got str"),
    (torch.tensor([1.0, 2.0]), "got a tensor of torch.float32"),
    (torch.tensor([[1, 2], [3, 4]]), r"one sequence, shape \[T\] or \[1, T\]; got \[2, 2\]"),
])
def test_bad_prompt(engine: Engine, ids: Any, needle: str) -> None:
    with pytest.raises(PromptError, match=needle):
        engine.generate(ids, max_new_tokens=1)
    with pytest.raises(PromptError, match=needle):
        engine.logits(ids)


def test_prompt_shapes_that_are_fine(engine: Engine) -> None:
    import numpy as np

    a = engine.logits([4, 5, 6])
    assert torch.equal(engine.logits(torch.tensor([[4, 5, 6]])), a)
    assert torch.equal(engine.logits(np.array([4, 5, 6], dtype=np.int32)), a)


def test_prompt_longer_than_the_context(engine: Engine) -> None:
    with pytest.raises(ContextLengthError, match=f"the prompt has {CONTEXT + 1} tokens but the model's context is "
                                                 f"{CONTEXT} positions"):
        engine.generate([1] * (CONTEXT + 1), max_new_tokens=1)
    with pytest.raises(ContextLengthError, match="no room to generate"):
        engine.generate([1] * CONTEXT, max_new_tokens=1)


def test_generation_stops_at_the_context(engine: Engine) -> None:
    out = engine.generate([1] * (CONTEXT - 3), max_new_tokens=50, stop_token_ids=[])
    assert out.completion_tokens == 3 and out.finish_reason == "length"


# ----------------------------------------------------------------------------------------------- sampling

SAMPLING_CASES: list[tuple[dict[str, Any], str]] = [
    ({"temperature": NAN}, "temperature must be a finite number ≥ 0, got nan"),
    ({"temperature": INF}, "temperature must be a finite number ≥ 0, got inf"),
    ({"temperature": -0.5}, "temperature must be a finite number ≥ 0, got -0.5"),
    ({"temperature": "0.7"}, "temperature must be a finite number ≥ 0, got '0.7'"),
    ({"top_p": 0.0}, r"top_p must be a finite number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a finite number in \(0, 1\]"),
    ({"top_p": NAN}, "top_p must be a finite number"),
    ({"top_k": -1}, "top_k must be an integer ≥ 0, got -1"),
    ({"top_k": 2.5}, "top_k must be an integer ≥ 0, got 2.5"),
    ({"max_new_tokens": -1}, "max_new_tokens must be an integer ≥ 0, got -1"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
    ({"seed": 2**70}, "seed must be an integer in"),
    ({"stop": "abc"}, "stop must be a list of strings, got 'abc'"),
    ({"stop": ["ok", 3]}, "stop must be a list of strings"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids must be a list of integers ≥ 0"),
]


@pytest.mark.parametrize("kwargs, needle", SAMPLING_CASES, ids=[str(c[0]) for c in SAMPLING_CASES])
def test_bad_sampling_params(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(SamplingError, match=needle):
        SamplingParams(**kwargs)


def test_bad_sampling_through_the_engine(engine: Engine) -> None:
    with pytest.raises(SamplingError, match="temperature must be a finite number"):
        engine.generate([1, 2], temperature=NAN)
    with pytest.raises(SamplingError, match="top_p"):
        list(engine.iter_generate([1, 2], top_p=2.0))


def test_tiny_temperature_is_greedy_not_nan() -> None:
    """Logits / 1e-30 overflow; shifted by their max first, the sample is the argmax instead of a NaN crash."""
    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    sampler = Sampler(SamplingParams(temperature=1e-30, seed=0))
    assert [sampler(logits) for _ in range(5)] == [1] * 5


# ----------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("kwargs, needle", [({"threads": 0}, "threads must be an integer ≥ 1, got 0"),
                                            ({"threads": -2}, "threads must be an integer ≥ 1"),
                                            ({"dtype": "int8"}, "unknown dtype 'int8'"),
                                            ({"quant": "q3"}, "unknown --quant 'q3'"),
                                            ({"device": "banana"}, "unknown device 'banana'; use cpu, or cuda"),
                                            ({"device": "cuda:64"}, "device 'cuda:64' asked for, but torch sees")])
def test_bad_engine_option(base: Path, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(OptionError, match=needle):
        Engine.from_pretrained(base, **kwargs)


def test_bad_threads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_THREADS", "zero")
    with pytest.raises(OptionError, match="FREETOKEN_THREADS must be an integer ≥ 1, got 'zero'"):
        configure_threads()
