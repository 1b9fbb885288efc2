"""Qwen4-Exp: Gated DeltaNet and query-selected attention layers (``model/qsa.py``) under gated-residual
hyper-connections (``model/gated_hyper.py``), hashed n-gram per-layer embeddings on some Gated DeltaNet layers
(``model/ngram.py``), softmax MoE with a gated shared expert."""

from __future__ import annotations

from freetoken_agent.runtime.model.adapters import Config, activation_name, gqa_spec, model_spec, adapter
from freetoken_agent.runtime.model.gated_hyper import FINAL_MIX, SUBLAYERS
from freetoken_agent.runtime.model.qsa import INDEXER
from freetoken_agent.runtime.model.spec import (
    ExtraTensor,
    GatedHyperSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NGramSpec,
    QSASpec,
    RecurrentSpec,
    RouterSpec,
    WeightNames,
)

HASH_BUFFERS = r"\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_offsets|ngram_heads_vocab_sizes)$"
"""Hash constants transformers stores as buffers; they follow from the config and are recomputed (``ngram.hashing``)."""


def sliding_layers(cfg: Config, n: int) -> list[str]:
    types = cfg.get("layer_types")
    if not types:
        interval = int(cfg.get("full_attention_interval") or 4)
        return ["linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n)]
    types = ["indexed_attention" if t == "full_attention" else t for t in types]  # published configs say "full"
    if len(types) != n or set(types) - {"linear_attention", "indexed_attention"}:
        raise ValueError(f"layer_types must be {n} entries of 'linear_attention' / 'indexed_attention'")
    return types


def _hyper_extras(streams: int, d: int, rank: int, inject: bool, prefix: str) -> list[ExtraTensor]:
    """One gated residual's weights, in the model dtype (the reference keeps none of them in fp32)."""
    nd = streams * d
    out = [(f"{prefix}.hc_norm.weight", (nd,)), (f"{prefix}.input_mix_weight_down.weight", (rank, nd)),
           (f"{prefix}.input_mix_weight_up.weight", (nd, rank))]
    out += [(f"{prefix}.block_inject_weight.weight", (streams, nd))] if inject else []
    return [ExtraTensor(name, shape, fp32=False) for name, shape in out]


@adapter("qwen4_exp_text")
def qwen4_exp(cfg: Config) -> ModelSpec:
    n, d = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    act, types = activation_name(cfg), sliding_layers(cfg, n)
    streams, rank = int(cfg.get("hc_count") or 4), int(cfg["hc_lowrank"])
    if streams < 2:
        raise ValueError(f"hc_count must be > 1, got {streams}")
    gate_act = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate_act not in ("silu", "sigmoid"):
        raise ValueError(f"output_gate_type {gate_act!r} is not supported (silu or sigmoid)")
    recurrent = RecurrentSpec(
        kind="gated_deltanet", num_k_heads=int(cfg["linear_num_key_heads"]),
        num_v_heads=int(cfg["linear_num_value_heads"]), head_k_dim=int(cfg["linear_key_head_dim"]),
        head_v_dim=int(cfg["linear_value_head_dim"]), conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        layout="split", activation=act, gate_activation=gate_act,
    )
    qsa = None
    if "indexed_attention" in types:
        fields = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
        if any(cfg.get(f) is None for f in fields) or int(cfg.get("indexer_kv_heads") or 1) != 1:
            raise ValueError(f"indexed_attention layers need {', '.join(fields)} and indexer_kv_heads = 1")
        qsa = QSASpec(num_heads=int(cfg["indexer_n_heads"]), head_dim=int(cfg["indexer_head_dim"]),
                      budget=int(cfg["indexer_budget"]), ratio=int(cfg["indexer_compress_ratio"]))
    bias = bool(cfg.get("attention_bias", False))
    attention = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", q_gate=True, qsa=qsa)
    shared = int(cfg["shared_expert_intermediate_size"])
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=bool(cfg.get("norm_topk_prob", True))),
        activation=act, shared=MLPSpec(shared, act), shared_gate=True,  # type: ignore[arg-type]
    )
    ple_ids = sorted(set(cfg.get("ple_layer_ids") or []))
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if ple_ids and not isinstance(eos, int):
        raise ValueError("per-layer embeddings (ple_layer_ids) need an eos_token_id")
    layers = []
    for i, kind in enumerate(types):
        ple = None
        if i + 1 in ple_ids:
            if kind != "linear_attention":
                raise ValueError(f"ple_layer_ids: layer {i + 1} is not a linear_attention layer")
            ple = NGramSpec(
                ngram_size=int(cfg.get("ngram_size", 3)), heads_per_ngram=int(cfg.get("heads_per_ngram", 8)),
                vocab_base=int(cfg.get("ngram_vocab_size_base", 20_000_000)),
                divisor=int(cfg.get("make_ngram_vocab_size_divisible_by", 128)), seed=int(cfg.get("seed", 1234)),
                eos=int(eos), vocab=int(cfg["vocab_size"]), dim=int(cfg.get("ple_embed_dim") or d),
                conv_kernel=int(cfg.get("ple_conv_kernel_size", 4)), index=ple_ids.index(i + 1),
                shards=int(cfg.get("split_ngram_parts", 512)),
            )
        extras = [e for name in SUBLAYERS for e in _hyper_extras(streams, d, rank, True, name)]
        if kind == "indexed_attention":
            assert qsa is not None
            extras += [ExtraTensor(f"{INDEXER}.index_qk_proj.weight", ((qsa.num_heads + 1) * qsa.head_dim, d), False),
                       ExtraTensor(f"{INDEXER}.q_layernorm.weight", (qsa.head_dim,), False),
                       ExtraTensor(f"{INDEXER}.k_layernorm.weight", (qsa.head_dim,), False)]
        layers.append(LayerSpec(attention=attention, moe=moe, ple=ple, extras=tuple(extras),
                                recurrent=recurrent if kind == "linear_attention" else None))
    names = WeightNames(shared="shared_expert", attn_in_norm=None, ffn_in_norm=None, final_norm=None)
    return model_spec(cfg, layers, names=names, gated_hyper=GatedHyperSpec(streams=streams, rank=rank),
                  extras=tuple(_hyper_extras(streams, d, rank, False, FINAL_MIX)),
                  ignored_tensors=(HASH_BUFFERS, r"^mtp\."))
