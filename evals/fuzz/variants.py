"""Option variants of a tiny config, read from the transformers config class's own fields.

Each generator looks at the tiny config's fields (``tiny.make_config(model_type).to_dict()``, so every default the
config class declares is there) and proposes valid values a user could load: every activation in ``ACT2CLS``, every
rope type in ``ROPE_INIT_FUNCTIONS`` with its parameters, partial rotary factors giving odd and even rotary dims,
flipped booleans, per-layer lists where a scalar is usual, sparse-layer patterns, shared-expert counts and sizes,
latent sizes, other values of multipliers and scaling factors — top-level fields and the fields of nested sub-config dicts alike. Whether transformers accepts a
variant is decided by running it (``options.check``), never guessed here.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.evals.fuzz.tiny import N_LAYERS, make_config

Config = dict[str, Any]

# Fields every config has that are not model options, and switches that change no logits in inference.
_NOT_OPTIONS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "id2label", "is_encoder_decoder",
    "label2id", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "use_cache", "output_router_logits",
})
_ACT_KEY = re.compile(r"(^|_)(act|activation)(_|$)|_act_fn$|^ffn_act_fn\.name$")
_LIST_KEY = re.compile(r"(topk|top_k|experts_per_tok|^moe_k$|intermediate_size|shared_expert|^num_experts$)")
_PATTERN_KEY = re.compile(r"^(decoder_sparse_step|moe_layer_freq|moe_layer_interval|first_k_dense_replace|"
                          r"num_dense_layers|moe_layer_start_index|moe_layer_end_index|expert_layer_period|"
                          r"expert_layer_offset|attn_layer_period|attn_layer_offset)$")
_SHARED_COUNT_KEY = re.compile(r"^(n_shared_experts|num_shared_experts?|moe_num_shared_experts|shared_expert_count|"
                               r"num_shared_expert)$")
_SHARED_SIZE_KEY = re.compile(r"shared.*(intermediate|size|dim)|(intermediate|size).*shared")
_LATENT_KEY = re.compile(r"latent")
_SCALE_KEY = re.compile(r"(multiplier|scaling_factor|_scale$|_scaling$|softcap|alpha_factor|beta_factor)")


@dataclass(frozen=True)
class Variant:
    """One option value of one model type: ``option`` is the field's path (``a.b`` inside sub-configs)."""

    model_type: str
    kind: str
    """The generator: ``act``, ``rope``, ``partial_rotary``, ``bool``, ``per_layer``, ``pattern``, ``shared``,
    ``latent``, ``scale``."""
    option: str
    value: str
    """Short display of the value."""
    overrides: Config = field(compare=False, hash=False)
    """Top-level ``make_config`` keyword arguments (a whole sub-config dict when a nested field changes)."""

    @property
    def name(self) -> str:
        return f"{self.model_type}:{self.option}={self.value}"


def _leaves(cfg: Config, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every field, descending into sub-config dicts (two levels deep)."""
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if key in _NOT_OPTIONS:
            continue
        if isinstance(value, dict) and key not in ("rope_parameters", "rope_scaling") and depth < 2:
            yield from _leaves(value, f"{path}.", depth + 1)
        else:
            yield path, value


def _set(base: Config, path: str, value: Any) -> Config:
    """Top-level overrides that set the field at ``path`` (copying the enclosing sub-config)."""
    top, *rest = path.split(".")
    if not rest:
        return {top: value}
    sub = copy.deepcopy(base[top])
    node = sub
    for key in rest[:-1]:
        node = node[key]
    node[rest[-1]] = value
    return {top: sub}


def _head_dim(cfg: Config) -> int:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    hidden = cfg.get("hidden_size") or cfg.get("d_model")
    heads = cfg.get("num_attention_heads") or cfg.get("n_heads")
    return int(hidden) // int(heads) if hidden and heads else 16


# ----------------------------------------------------------------------------------------------- generators


def activations(model_type: str, cfg: Config) -> Iterator[Variant]:
    from transformers.activations import ACT2CLS

    for path, value in _leaves(cfg):
        if isinstance(value, str) and value in ACT2CLS and _ACT_KEY.search(path):
            for act in ACT2CLS:
                if act != value:
                    yield Variant(model_type, "act", path, act, _set(cfg, path, act))


_ROPE_KEYS = frozenset({"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                        "attention_factor", "short_factor", "long_factor", "low_freq_factor", "high_freq_factor",
                        "truncate", "alpha"})
"""Parameters of the transformers rope types (replaced by the variant's own)."""


def _rope_entry(kind: str, entry: Config, rotary_dim: int, max_pos: int) -> Config:
    """``entry`` turned into a ``kind`` rope whose scaling bites at the test length (the original context is 16
    positions, shorter than the prompt). Theta, the partial factor and keys no rope type defines (a model's own
    extras, e.g. Mistral 4's ``llama_4_scaling_beta``, PhiMoE's ``short_mscale``) are kept."""
    keep = {k: v for k, v in entry.items() if k in ("rope_theta", "partial_rotary_factor") or k not in _ROPE_KEYS}
    if entry.get("rope_type") == "proportional" and kind != "proportional":
        keep.pop("partial_rotary_factor", None)  # proportional's factor zeroes frequencies; others would cut dims
    half = max(rotary_dim // 2, 1)
    params: dict[str, Config] = {
        "default": {},
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 2.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
        "longrope": {"short_factor": [1.0 + 0.1 * i for i in range(half)],
                     "long_factor": [1.5 + 0.25 * i for i in range(half)],
                     "original_max_position_embeddings": 16, "factor": max_pos / 16},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16},
        "proportional": {"factor": 2.0},
    }
    return {"rope_type": kind, **keep, **params.get(kind, {"factor": 2.0})}


def _rotary_dim(cfg: Config, entry: Config) -> int:
    if cfg.get("qk_rope_head_dim"):
        return int(cfg["qk_rope_head_dim"])
    return int(_head_dim(cfg) * float(entry.get("partial_rotary_factor", 1.0)))


def _map_rope(cfg: Config, fn: Callable[[Config], Config]) -> Config:
    """``rope_parameters`` with ``fn`` applied to each entry (per layer type when it has one rope per type)."""
    rope = cfg["rope_parameters"]
    if all(isinstance(v, dict) or v is None for v in rope.values()):
        return {k: (fn(v) if v is not None else None) for k, v in rope.items()}
    return fn(rope)


def ropes(model_type: str, cfg: Config) -> Iterator[Variant]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(cfg.get("rope_parameters"), dict):
        return
    max_pos = int(cfg.get("max_position_embeddings") or 512)
    for kind in ("default", *ROPE_INIT_FUNCTIONS):
        rope = _map_rope(cfg, lambda e, kind=kind: _rope_entry(kind, e, _rotary_dim(cfg, e), max_pos))
        overrides: Config = {"rope_parameters": rope}
        if kind == "dynamic":  # dynamic NTK only changes frequencies past max_position_embeddings
            overrides["max_position_embeddings"] = 16
        yield Variant(model_type, "rope", "rope_parameters.rope_type", kind, overrides)


def partial_rotary(model_type: str, cfg: Config) -> Iterator[Variant]:
    if not isinstance(cfg.get("rope_parameters"), dict) or cfg.get("qk_rope_head_dim"):
        return  # MLA rotates qk_rope_head_dim channels, not a fraction of the head
    head_dim = _head_dim(cfg)
    for dim in (head_dim // 4 + 1, head_dim // 2, head_dim // 2 + 1, head_dim):
        factor = dim / head_dim
        rope = _map_rope(cfg, lambda e, f=factor: {**e, "partial_rotary_factor": f})
        yield Variant(model_type, "partial_rotary", "partial_rotary_factor", f"{factor:g} (dim {dim})",
                      {"rope_parameters": rope})


def booleans(model_type: str, cfg: Config) -> Iterator[Variant]:
    for path, value in _leaves(cfg):
        if isinstance(value, bool):
            yield Variant(model_type, "bool", path, str(not value), _set(cfg, path, not value))


def per_layer(model_type: str, cfg: Config) -> Iterator[Variant]:
    """A scalar size or count given as one value per layer (one layer differs)."""
    for path, value in _leaves(cfg):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and _LIST_KEY.search(path):
            other = value + 1 if value == 1 or re.search("topk|top_k|per_tok|moe_k", path) else value // 2
            values = [value] * N_LAYERS
            values[1] = other
            yield Variant(model_type, "per_layer", path, str(values), _set(cfg, path, values))


def patterns(model_type: str, cfg: Config) -> Iterator[Variant]:
    """Which layers are sparse: steps, frequencies, dense prefixes, offsets, ``mlp_only_layers``."""
    for path, value in _leaves(cfg):
        key = path.rsplit(".", 1)[-1]
        if _PATTERN_KEY.match(key) and (value is None or (isinstance(value, int) and not isinstance(value, bool))):
            low = 0 if "offset" in key or "start" in key or key in ("first_k_dense_replace", "num_dense_layers") else 1
            for v in range(low, N_LAYERS):
                if v != value:
                    yield Variant(model_type, "pattern", path, str(v), _set(cfg, path, v))
        elif key == "mlp_only_layers":
            for layers in ([1], [0, 2]):
                if layers != value:
                    yield Variant(model_type, "pattern", path, str(layers), _set(cfg, path, layers))


def shared_experts(model_type: str, cfg: Config) -> Iterator[Variant]:
    """Shared-expert counts 0 and 2..3 and zero / other shared-expert sizes."""
    for path, value in _leaves(cfg):
        key = path.rsplit(".", 1)[-1]
        if isinstance(value, bool) or not (value is None or isinstance(value, int)):
            continue
        if _SHARED_COUNT_KEY.match(key):
            for n in (0, 2, 3):
                if n != value:
                    yield Variant(model_type, "shared", path, str(n), _set(cfg, path, n))
        elif _SHARED_SIZE_KEY.search(key):
            for size in (0, 40):
                if size != value:
                    yield Variant(model_type, "shared", path, str(size), _set(cfg, path, size))


def latents(model_type: str, cfg: Config) -> Iterator[Variant]:
    """Latent MoE sizes (experts computed in a down-projected space) and other ``*latent*`` widths."""
    for path, value in _leaves(cfg):
        if _LATENT_KEY.search(path) and (value is None or (isinstance(value, int) and not isinstance(value, bool))):
            for size in (32, 48):
                if size != value:
                    yield Variant(model_type, "latent", path, str(size), _set(cfg, path, size))


def scales(model_type: str, cfg: Config) -> Iterator[Variant]:
    """Multipliers, scaling factors and soft caps: 1.5x the default (0.5 where the default is 0, i.e. off)."""
    for path, value in _leaves(cfg):
        if isinstance(value, float) and _SCALE_KEY.search(path.rsplit(".", 1)[-1]):
            new = value * 1.5 if value else 0.5
            yield Variant(model_type, "scale", path, f"{new:g}", _set(cfg, path, new))


GENERATORS: dict[str, Callable[[str, Config], Iterator[Variant]]] = {
    "act": activations, "rope": ropes, "partial_rotary": partial_rotary, "bool": booleans, "per_layer": per_layer,
    "pattern": patterns, "shared": shared_experts, "latent": latents, "scale": scales,
}


def variants(model_type: str, kinds: tuple[str, ...] | None = None) -> list[Variant]:
    """Every variant of ``model_type``'s tiny config (deduplicated by option and value)."""
    cfg = make_config(model_type).to_dict()
    out: dict[tuple[str, str], Variant] = {}
    for kind, gen in GENERATORS.items():
        if kinds is None or kind in kinds:
            for v in gen(model_type, cfg):
                out.setdefault((v.option, v.value), v)
    return list(out.values())


def sample(items: list[Variant], n: int, seed: int) -> list[Variant]:
    """A fixed seeded sample of ``n`` variants, spread over kinds first (round-robin), then at random."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Variant]] = {}
    for v in sorted(items, key=lambda v: v.name):
        by_kind.setdefault(v.kind, []).append(v)
    for group in by_kind.values():
        rng.shuffle(group)
    picked: list[Variant] = []
    while len(picked) < n and any(by_kind.values()):
        for kind in sorted(by_kind):
            if by_kind[kind] and len(picked) < n:
                picked.append(by_kind[kind].pop())
    return picked
