"""Strict loading of a checkpoint into the tensors the generic decoder uses.

Every parameter the spec implies must be present with the right shape, and every checkpoint tensor must be either
used or matched by ``ModelSpec.ignored_tensors``; otherwise a specific exception names the tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.checkpoint.experts import ExpertSource
from freetoken_agent.runtime.checkpoint.reader import CheckpointReader
from freetoken_agent.runtime.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from freetoken_agent.runtime.model.activations import LEARNED, default_params
from freetoken_agent.runtime.model.compressed import load_shared_kv
from freetoken_agent.runtime.model.cca import cca_weights
from freetoken_agent.runtime.model.gemma import per_layer_activation
from freetoken_agent.runtime.model.mlp_router import mlp_router_weights
from freetoken_agent.runtime.model.moe import TorchExperts, silu_kernel_spec
from freetoken_agent.runtime.model.ngram import ple_weights
from freetoken_agent.runtime.model.relpos import relpos_weights
from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RecurrentSpec,
    WeightNames,
)

# Tensors some exporters write that carry no weights we need.
ALWAYS_IGNORED = (r"\.rotary_emb\.inv_freq$", r"\._extra_state$")
_ACT_MODULES = ("act_fn", "activation_fn", "activation", "act")
"""The names transformers' modeling code gives an activation module (``self.act_fn = ACT2FN[...]`` and kin)."""


@dataclass
class MoEWeights:
    router: dict[str, torch.Tensor]  # weight [E, D], optional bias [E]
    correction: torch.Tensor | None  # [E]
    experts: TorchExperts
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    shared_gate: torch.Tensor | None = None  # [1, D]
    output_norm: torch.Tensor | None = None  # [D]
    expert_norm: torch.Tensor | None = None  # [E, D] fp32: each routed expert's output norm (Ergo)
    shared_norm: torch.Tensor | None = None  # [D]: the shared expert's output norm (Ergo)
    output_bias: torch.Tensor | None = None  # [D]
    latent: dict[str, torch.Tensor] = field(default_factory=dict)
    """Latent MoE projections: ``fc1_latent_proj.weight`` [L, D], ``fc2_latent_proj.weight`` [D, L] (+ biases)."""


@dataclass
class LayerWeights:
    norms: dict[str, torch.Tensor]
    """Keyed by role: ``attn_in``, ``attn_out``, ``ffn_in``, ``ffn_out`` (only those the spec names)."""
    attn: dict[str, torch.Tensor]
    mlp: dict[str, torch.Tensor] | None = None
    moe: MoEWeights | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    norm: torch.Tensor | None  # [D] (None: no final norm)
    lm_head: torch.Tensor  # [V, D] (the embedding itself when tied)
    lm_head_bias: torch.Tensor | None
    layers: list[LayerWeights]
    norm_bias: torch.Tensor | None = None
    hyper_head: dict[str, torch.Tensor] = field(default_factory=dict)
    embed_norm: torch.Tensor | None = None  # [D]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """``ModelSpec.extras`` by name."""
    per_layer: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gemma 4 per-layer inputs: ``embed`` [V', L·P], ``projection`` [L·P, D], ``norm`` [P]."""


class TensorLoader:
    """Takes checkpoint tensors by name with their expected shapes (``take``); subclassed to record or remap them."""

    norm_offset = 0.0
    layer = -1
    """Index (in ``ModelSpec.layers``) of the layer being loaded."""

    def share_layer(self, layer: int, base: int) -> None:
        """Layer ``layer`` repeats layer ``base`` and shares its weights (loaders that track layers follow it)."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype, device: torch.device | str,
                 expert_dtype: torch.dtype | None = None) -> None:
        self.reader, self.dtype, self.device = reader, dtype, device
        self.expert_dtype = expert_dtype
        """A 16-bit dtype the routed experts of kernel-run layers stay in when the checkpoint stores them so (see
        ``experts``); None: every expert in ``dtype``."""

    def mark_used(self, name: str) -> None:
        self.reader.used.add(name)

    def stored_shape(self, name: str) -> tuple[int, ...] | None:
        return self.reader.shape(name) if name in self.reader else None

    def stored_under(self, prefix: str) -> list[str]:
        """Names of the checkpoint's tensors that start with ``prefix``."""
        return [n for n in self.reader.infos if n.startswith(prefix)]

    def skip_empty_shared(self, base: str, gate: str) -> None:
        """A zero-width shared expert (transformers builds one for ``n_shared_experts: 0`` or a shared size of 0)
        computes exactly 0: its empty projections, and a gate that would scale that 0, are read as absent. A
        non-empty tensor among them (a down bias) does contribute, so it stays unexpected; a learned activation's
        parameters (its ``act_fn``) act on nothing there."""
        found = self.stored_under(f"{base}.")
        acts = tuple(f"{base}.{leaf}." for leaf in _ACT_MODULES)
        weights = [n for n in found if not n.startswith(acts)]
        if weights and all(math.prod(self.stored_shape(n) or (1,)) == 0 for n in weights):
            for name in (*found, gate):
                self.mark_used(name)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.reader:
            raise MissingTensorError(f"missing tensor {name} (expected shape {list(shape)})")
        if self.reader.shape(name) != shape:
            raise ShapeMismatchError(
                f"tensor {name} has shape {list(self.reader.shape(name))}, expected {list(shape)}"
            )
        return self.reader.get(name).to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return self.reader.read(name).dtype if name in self.reader else None

    def activation(self, name: str, *bases: str, key: str = "act") -> dict[str, torch.Tensor]:
        """A learned activation's parameters at one site as ``{key}.{param}`` (``{}`` for a plain activation):
        read from the first activation module (``_ACT_MODULES``) under one of ``bases`` that stores them, in their
        stored dtype (transformers' xIELU computes its coefficients in it: bf16)."""
        shapes = LEARNED.get(name)
        if not shapes:
            return {}
        first = next(iter(shapes))
        module = next((f"{b}.{leaf}" for b in bases for leaf in _ACT_MODULES
                       if self.stored_shape(f"{b}.{leaf}.{first}") is not None), f"{bases[0]}.act_fn")
        return {f"{key}.{p}": self.take(f"{module}.{p}", shape, self.stored_dtype(f"{module}.{p}"))
                for p, shape in shapes.items()}

    def conv_activation(self, prefix: str, name: str) -> dict[str, torch.Tensor]:
        """The activation after a recurrent mixer's convolution, as ``act.{param}``. transformers applies it as
        ``ACT2FN[name](x)``, a module built anew on every call: a learned one computes with its default parameters,
        and the ``act`` module the mixer also builds (stored, never called) is knowingly left unread."""
        for stored in self.stored_under(f"{prefix}.act."):
            self.mark_used(stored)
        return {f"act.{p}": t.to(self.device) for p, t in default_params(name).items()}

    def take_ids(self, name: str, shape: tuple[int, ...], limit: int) -> torch.Tensor:
        """An integer index table (int64) whose entries must lie in ``0..limit-1`` (a hash router's token → expert
        ids); read without the floating-point weight checks."""
        if name not in self.reader:
            raise MissingTensorError(f"missing tensor {name} (expected shape {list(shape)})")
        if self.reader.shape(name) != shape:
            raise ShapeMismatchError(f"tensor {name} has shape {list(self.reader.shape(name))}, expected {list(shape)}")
        table = self.reader.read(name)
        if table.is_floating_point() or table.is_complex():
            raise ShapeMismatchError(f"tensor {name} holds {table.dtype} values, expected integer ids")
        if table.numel() and not (0 <= int(table.min()) and int(table.max()) < limit):
            raise ShapeMismatchError(f"tensor {name} holds ids outside 0..{limit - 1}")
        return table.to(device=self.device, dtype=torch.int64).contiguous()

    def linear(self, out: dict[str, torch.Tensor], prefix: str, leaf: str, n_out: int, n_in: int, bias: bool,
               key: str | None = None) -> None:
        key = key or leaf
        out[f"{key}.weight"] = self.take(f"{prefix}.{leaf}.weight", (n_out, n_in))
        if bias:
            out[f"{key}.bias"] = self.take(f"{prefix}.{leaf}.bias", (n_out,))

    def norm(self, name: str, dim: int) -> torch.Tensor:
        weight = self.take(name, (dim,))
        return weight + self.norm_offset if self.norm_offset else weight

    def recurrent(self, prefix: str, r: RecurrentSpec, d: int) -> dict[str, torch.Tensor]:
        w: dict[str, torch.Tensor] = {}
        if r.kind == "short_conv":
            self.linear(w, prefix, "in_proj", 3 * d, d, r.conv_bias)
            w["conv.weight"] = self.take(f"{prefix}.conv.weight", (d, 1, r.conv_kernel))
            if r.conv_bias:
                w["conv.bias"] = self.take(f"{prefix}.conv.bias", (d,))
            self.linear(w, prefix, "out_proj", d, d, r.conv_bias)
            return w
        # lightning: a stored act_fn on the qkv projection; the others: the convolution's activation
        w.update(self.activation(r.activation, prefix) if r.kind == "lightning"
                 else self.conv_activation(prefix, r.activation))
        hk, hv, dk, dv = r.num_k_heads, r.num_v_heads, r.head_k_dim, r.head_v_dim
        if r.kind == "kda":
            h, dk = r.num_v_heads, r.head_k_dim
            for name in "qkv":
                self.linear(w, prefix, f"{name}_proj", h * dk, d, False)
                w[f"{name}_conv1d.weight"] = self.take(f"{prefix}.{name}_conv1d.weight", (h * dk, 1, r.conv_kernel))
            for gate in "fg":
                if r.gate_lowrank:
                    self.linear(w, prefix, f"{gate}_a_proj", dk, d, False)
                    self.linear(w, prefix, f"{gate}_b_proj", h * dk, dk, False)
                else:
                    self.linear(w, prefix, f"{gate}_proj", h * dk, d, False)
            self.linear(w, prefix, "b_proj", h, d, False)
            w["dt_bias"] = self.take(f"{prefix}.dt_bias", (h * dk,))
            w["A_log"] = self.take(f"{prefix}.A_log", (1, 1, h, 1) if r.gate_lowrank else (h,))
            w["o_norm.weight"] = self.take(f"{prefix}.o_norm.weight", (dk,))
            self.linear(w, prefix, r.out_proj, d, h * dk, False, key="o_proj")
            return w
        if r.kind == "lightning":
            inner = r.num_v_heads * r.head_v_dim
            self.linear(w, prefix, "qkv_proj", 3 * inner, d, False)
            self.linear(w, prefix, "output_gate", inner, d, False)
            w["norm.weight"] = self.take(f"{prefix}.norm.weight", (inner,))
            self.linear(w, prefix, "out_proj", d, inner, False)
            return w
        if r.kind == "mamba":
            inner, rank, n = r.num_v_heads, r.num_k_heads, r.head_k_dim
            self.linear(w, prefix, "in_proj", 2 * inner, d, r.proj_bias)
            w["conv1d.weight"] = self.take(f"{prefix}.conv1d.weight", (inner, 1, r.conv_kernel))
            if r.conv_bias:
                w["conv1d.bias"] = self.take(f"{prefix}.conv1d.bias", (inner,))
            self.linear(w, prefix, "x_proj", rank + 2 * n, inner, False)
            self.linear(w, prefix, "dt_proj", inner, rank, True)
            w["A_log"] = self.take(f"{prefix}.A_log", (inner, n))
            w["D"] = self.take(f"{prefix}.D", (inner,))
            if r.inner_norms:
                for leaf, size in (("dt_layernorm", rank), ("b_layernorm", n), ("c_layernorm", n)):
                    w[f"{leaf}.weight"] = self.take(f"{prefix}.{leaf}.weight", (size,))
            self.linear(w, prefix, "out_proj", d, inner, r.proj_bias)
            return w
        if r.kind == "mamba2":
            inner, conv_dim = hv * dv, hv * dv + 2 * hk * dk
            self.linear(w, prefix, "in_proj", inner + conv_dim + hv, d, r.proj_bias)
            w["conv1d.weight"] = self.take(f"{prefix}.conv1d.weight", (conv_dim, 1, r.conv_kernel))
            if r.conv_bias:
                w["conv1d.bias"] = self.take(f"{prefix}.conv1d.bias", (conv_dim,))
            for leaf in ("dt_bias", "A_log", "D"):
                w[leaf] = self.take(f"{prefix}.{leaf}", (hv,))
            w["norm.weight"] = self.take(f"{prefix}.{r.norm}.weight", (inner,))
            self.linear(w, prefix, "out_proj", d, inner, r.proj_bias)
            return w
        conv_dim = 2 * hk * dk + hv * dv
        if r.layout == "grouped":
            self.linear(w, prefix, "in_proj_qkvz", 2 * hk * dk + 2 * hv * dv, d, False)
            self.linear(w, prefix, "in_proj_ba", 2 * hv, d, False)
        elif r.layout == "fused":
            self.linear(w, prefix, "in_proj", conv_dim + hv * dv + 2 * hv, d, False)
        else:
            for leaf, n_out in (("in_proj_qkv", conv_dim), ("in_proj_z", hv * dv), ("in_proj_b", hv), ("in_proj_a", hv)):
                self.linear(w, prefix, leaf, n_out, d, False)
        w["conv1d.weight"] = self.take(f"{prefix}.conv1d.weight", (conv_dim, 1, r.conv_kernel))
        if r.conv_bias:
            w["conv1d.bias"] = self.take(f"{prefix}.conv1d.bias", (conv_dim,))
        w["dt_bias"] = self.take(f"{prefix}.dt_bias", (hv,))
        w["A_log"] = self.take(f"{prefix}.A_log", (hv,))
        w["norm.weight"] = self.take(f"{prefix}.{r.norm}.weight", (dv,))
        self.linear(w, prefix, "out_proj", d, hv * dv, False)
        return w

    def mlp(self, prefix: str, spec: MLPSpec, d: int) -> dict[str, torch.Tensor]:
        w: dict[str, torch.Tensor] = self.activation(spec.activation, prefix)
        if spec.fused:
            gate_up, down = spec.fused_names
            self.linear(w, prefix, gate_up, 2 * spec.intermediate, d, spec.bias, key="input_linear")
            self.linear(w, prefix, down, d, spec.intermediate, spec.bias, key="output_linear")
            return w
        gate, up, down = spec.leaves
        if spec.gated:
            self.linear(w, prefix, gate, spec.intermediate, d, spec.bias, key="gate_proj")
        self.linear(w, prefix, up, spec.intermediate, d, spec.bias, key="up_proj")
        self.linear(w, prefix, down, d, spec.intermediate, spec.bias, key="down_proj")
        if spec.out_scale:
            w["global_scale"] = self.take(f"{prefix}.global_scale", (1,))
        return w

    def attention(self, prefix: str, a: AttentionSpec, d: int, names: WeightNames) -> dict[str, torch.Tensor]:
        w: dict[str, torch.Tensor] = {}
        if a.kind == "shared_kv":  # DeepSeek-V4
            return load_shared_kv(self, prefix, a, d)
        if a.kv_source is not None:  # Gemma 4 KV sharing: only queries and the output
            self.linear(w, prefix, "q_proj", a.num_heads * a.head_dim, d, a.qkv_bias)
            self.linear(w, prefix, names.o_proj, d, a.num_heads * a.v_head_dim, a.o_bias, key="o_proj")
            if a.qk_norm == "head":
                w["q_norm.weight"] = self.norm(f"{prefix}.{names.q_norm}.weight", a.head_dim)
            return w
        if a.kind == "moa":  # JetMoE: routed query/output experts, shared key/value projection
            e, inner = a.num_heads // a.num_kv_heads, a.num_kv_heads * a.head_dim
            experts = self.stored_shape(f"{prefix}.experts.router.layer.weight")
            n_exp = experts[0] if experts else e
            w["router.weight"] = self.take(f"{prefix}.experts.router.layer.weight", (n_exp, d))
            w["input_linear.weight"] = self.take(f"{prefix}.experts.input_linear.weight", (n_exp, inner, d))
            w["output_linear.weight"] = self.take(f"{prefix}.experts.output_linear.weight", (n_exp, d, inner))
            w["bias"] = self.take(f"{prefix}.experts.bias", (d,))
            self.linear(w, prefix, "kv_proj", 2 * inner, d, False)
            return w
        if a.kind == "relpos":
            return relpos_weights(self, prefix, a, d)
        if a.kind == "cca":
            return cca_weights(self, prefix, a, d, *a.cca_kernels)
        if a.kind == "mla":
            if a.q_lora_rank is None:
                self.linear(w, prefix, "q_proj", a.num_heads * a.head_dim, d, False)
            else:
                self.linear(w, prefix, "q_a_proj", a.q_lora_rank, d, a.lora_bias)
                w["q_a_layernorm.weight"] = self.take(f"{prefix}.q_a_layernorm.weight", (a.q_lora_rank,))
                if a.mla_q_gate:
                    self.linear(w, prefix, "q_b_proj", a.num_heads * (a.head_dim + a.v_head_dim), 2 * a.q_lora_rank,
                                False)
                else:
                    self.linear(w, prefix, "q_b_proj", a.num_heads * a.head_dim, a.q_lora_rank, False)
            self.linear(w, prefix, "kv_a_proj_with_mqa", a.kv_lora_rank + a.qk_rope_dim, d, a.lora_bias)
            w["kv_a_layernorm.weight"] = self.take(f"{prefix}.kv_a_layernorm.weight", (a.kv_lora_rank,))
            if a.k_rope_norm:
                w["k_rope_norm.weight"] = self.take(f"{prefix}.k_rope_only_layernorm.weight", (a.qk_rope_dim,))
            self.linear(w, prefix, "kv_b_proj", a.num_heads * (a.qk_nope_dim + a.v_head_dim), a.kv_lora_rank, False)
            self.linear(w, prefix, names.o_proj, d, a.num_heads * a.v_head_dim, a.o_bias, key="o_proj")
            if a.output_gate != "none":
                n_gate = a.num_heads if a.output_gate_per_head else a.num_heads * a.v_head_dim
                self.linear(w, prefix, names.output_gate, n_gate, d, False, key="gate")
            if a.sinks:
                w["sinks"] = self.take(f"{prefix}.{names.sinks}", (a.num_heads,))
            ix = a.indexer
            if ix is not None and not ix.shared:
                p = f"{prefix}.indexer"
                self.linear(w, p, "wq_b", ix.num_heads * ix.head_dim, a.q_lora_rank or d, False, key="indexer.wq_b")
                self.linear(w, p, "wk", ix.head_dim, d, False, key="indexer.wk")
                w["indexer.k_norm.weight"] = self.take(f"{p}.k_norm.weight", (ix.head_dim,))
                w["indexer.k_norm.bias"] = self.take(f"{p}.k_norm.bias", (ix.head_dim,))
                self.linear(w, p, "weights_proj", ix.num_heads, d, False, key="indexer.weights_proj")
            return w
        sizes = (a.num_heads * a.head_dim * (2 if a.q_gate else 1), a.num_kv_heads * a.head_dim,
                 a.num_kv_heads * a.v_head_dim)
        if names.fused_qkv:
            fused: dict[str, torch.Tensor] = {}
            self.linear(fused, prefix, names.fused_qkv, sum(sizes), d, a.qkv_bias, key="qkv")
            for part in ("weight", "bias") if a.qkv_bias else ("weight",):
                for leaf, t in zip(("q_proj", "k_proj", "v_proj"), fused[f"qkv.{part}"].split(sizes)):
                    w[f"{leaf}.{part}"] = t
        else:
            for leaf, n_out in zip(("q_proj", "k_proj", "v_proj"), sizes):
                if leaf != "v_proj" or not a.k_eq_v:
                    self.linear(w, prefix, leaf, n_out, d, a.qkv_bias)
        self.linear(w, prefix, names.o_proj, d, a.num_heads * a.v_head_dim, a.o_bias, key="o_proj")
        if a.qk_norm in ("head", "full"):
            q_dim = a.head_dim if a.qk_norm == "head" else a.num_heads * a.head_dim
            k_dim = a.head_dim if a.qk_norm == "head" else a.num_kv_heads * a.head_dim
            w["q_norm.weight"] = self.norm(f"{prefix}.{names.q_norm}.weight", q_dim)
            w["k_norm.weight"] = self.norm(f"{prefix}.{names.k_norm}.weight", k_dim)
        if a.sinks:
            w["sinks"] = self.take(f"{prefix}.{names.sinks}", (a.num_heads,))
        bx = a.block_indexer
        if bx is not None:
            self.linear(w, f"{prefix}.indexer", "q_proj", bx.num_heads * bx.head_dim, d, False, key="indexer.q_proj")
            self.linear(w, f"{prefix}.indexer", "k_proj", bx.head_dim, d, False, key="indexer.k_proj")
            w["indexer.q_norm.weight"] = self.norm(f"{prefix}.indexer.q_norm.weight", bx.head_dim)
            w["indexer.k_norm.weight"] = self.norm(f"{prefix}.indexer.k_norm.weight", bx.head_dim)
        if a.dynamic_mask:
            self.linear(w, prefix, "dt_proj", a.num_kv_heads, a.num_kv_heads * a.v_head_dim, a.qkv_bias)
            w["A"] = self.take(f"{prefix}.A", (a.num_kv_heads,))
        if a.output_gate != "none":
            n_gate = a.num_heads if a.output_gate_per_head else a.num_heads * a.v_head_dim
            self.linear(w, prefix, names.output_gate, n_gate, d, False, key="gate")
            if a.output_gate_bias:
                w["gate_bias"] = self.take(f"{prefix}.{names.output_gate_bias}", (a.num_heads,))
        return w

    def experts(self, prefix: str, m: MoESpec, names: WeightNames, d: int) -> TorchExperts:
        source = ExpertSource(self.reader, prefix, m, names, d)
        parts = [source.load(e) for e in range(m.num_experts)]
        cast = lambda ts: torch.stack(ts).to(device=self.device, dtype=self.dtype).contiguous()
        stored = self.expert_dtype
        if stored is not None and silu_kernel_spec(m) and all(
                p.gate_up.dtype == stored and p.down.dtype == stored for p in parts):
            # exact: the kernels widen each stored value to this value in registers, at half the bytes a step reads
            keep = lambda ts: torch.stack(ts).to(device=self.device).contiguous()  # noqa: E731
            return TorchExperts(m, gate_up=keep([p.gate_up for p in parts]), down=keep([p.down for p in parts]))
        return TorchExperts(
            m,
            gate_up=cast([p.gate_up for p in parts]),
            down=cast([p.down for p in parts]),
            gate_up_bias=cast([p.gate_up_bias for p in parts]) if m.expert_bias else None,
            down_bias=cast([p.down_bias for p in parts]) if m.expert_bias else None,
        )

    def moe(self, prefix: str, layer: LayerSpec, spec: ModelSpec, layer_prefix: str) -> MoEWeights:
        m, names, d = layer.moe, layer.names or spec.names, spec.hidden_size
        assert m is not None
        if m.kind == "product_key":
            keys = int(m.num_experts**0.5)
            router = {"weight": self.take(f"{prefix}.router_gate.weight", (2 * keys, d)),
                      "down_embed": self.take(f"{prefix}.down_embed.weight", (m.num_experts, d)),
                      "up_embed": self.take(f"{prefix}.up_embed.weight", (m.num_experts, d))}
            assert m.shared is not None
            return MoEWeights(router, None, None, shared=self.mlp(prefix, m.shared, d))  # type: ignore[arg-type]
        n_route = m.num_experts + m.zero_experts
        rp = f"{layer_prefix if names.router_at_layer else prefix}.{names.router}"  # the router projection
        if m.router.mlp_hidden:  # ZAYA: E + 1 classes (the last a skip expert)
            first = layer_prefix == f"{spec.names.layers}.0"
            router = mlp_router_weights(self, rp, d, m.router.mlp_hidden, n_route + 1, first)
        else:
            router = {"weight": self.take(f"{rp}.weight", (n_route + m.router.shared_sink, d))}
        owner = rp.rpartition(".")[0]  # the module holding it, and its learned scales (Gemma 4)
        if m.router.input_scale:
            router["scale"] = self.take(f"{owner}.scale", (d,))
        if m.router.expert_scale:
            router["expert_scale"] = self.take(f"{owner}.per_expert_scale", (n_route,), torch.float32)
        if m.router.global_scale:
            router["global_scale"] = self.take(f"{prefix}.{names.router}.global_scale", (1,), torch.float32)
        if m.router.bias:
            router["bias"] = self.take(f"{prefix}.{names.router}.bias", (n_route,))
        if m.router.hash_table:  # token id → experts (DeepSeek-V4 hash layers)
            router["tid2eid"] = self.take_ids(f"{prefix}.{names.router}.tid2eid", (spec.vocab_size, m.top_k), n_route)
        correction = None
        if m.router.correction_bias:
            name = f"{layer_prefix if names.correction_at_layer else prefix}.{names.correction_bias}"
            shape = self.stored_shape(name) or (n_route,)
            if shape not in ((n_route,), (1, n_route)):
                raise ShapeMismatchError(f"tensor {name} has shape {list(shape)}, expected [{n_route}]")
            correction = self.take(name, shape, torch.float32).reshape(-1)
        weights = MoEWeights(router, correction, self.experts(prefix, m, names, m.latent or d))
        weights.experts.act = {k.removeprefix("act."): t for k, t in
                               self.activation(m.activation, f"{prefix}.experts", f"{prefix}.experts.mlp",
                                               prefix).items()}
        if m.latent:
            self.linear(weights.latent, prefix, "fc1_latent_proj", m.latent, d, m.latent_bias)
            self.linear(weights.latent, prefix, "fc2_latent_proj", d, m.latent, m.latent_bias)
        if m.shared is not None and m.router.shared_sink:  # stacked [n, I, D], one routing share each
            n, i, base = m.router.shared_sink, m.shared.intermediate, f"{prefix}.{names.shared}"
            weights.shared = {leaf: self.take(f"{base}.{leaf}", shape) for leaf, shape in
                              (("gate_proj", (n, i, d)), ("up_proj", (n, i, d)), ("down_proj", (n, d, i)))}
            weights.shared.update(self.activation(m.shared.activation, base))
        elif m.shared is not None:
            base = layer_prefix if names.shared_at_layer else prefix
            weights.shared = self.mlp(f"{base}.{names.shared}", m.shared, d)
        else:
            base = layer_prefix if names.shared_at_layer else prefix
            self.skip_empty_shared(f"{base}.{names.shared}", f"{prefix}.{names.shared_gate}.weight")
        if m.output_bias:
            weights.output_bias = self.take(f"{prefix}.bias", (d,))
        if m.output_norm:
            weights.output_norm = self.take(f"{layer_prefix}.{names.moe_output_norm}.weight", (d,))
        if m.expert_out_norm:
            weights.expert_norm = self.take(f"{prefix}.{names.expert_out_norm}.weight", (m.num_experts, d),
                                            torch.float32)
        if m.shared_out_norm and m.shared is not None:
            base = layer_prefix if names.shared_at_layer else prefix
            weights.shared_norm = self.norm(f"{base}.{names.shared}.norm.weight", d)
        if m.shared_gate:
            weights.shared_gate = self.take(f"{prefix}.{names.shared_gate}.weight", (1, d))
        return weights


def load_weights(
    spec: ModelSpec,
    reader: CheckpointReader,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    on_layer: "callable | None" = None,  # type: ignore[valid-type]
    expert_dtype: torch.dtype | None = None,
) -> ModelWeights:
    """Read every tensor the spec needs; ``on_layer(i)`` is called after each layer (progress). ``expert_dtype``:
    see ``TensorLoader.expert_dtype``."""
    weights = walk_weights(spec, TensorLoader(reader, dtype, device, expert_dtype), on_layer)
    check_unused(spec, reader)
    return weights


def check_unused(spec: ModelSpec, reader: CheckpointReader) -> None:
    """``UnexpectedTensorError`` naming the first checkpoint tensor a walk left unread (and no pattern ignores)."""
    ignored = [re.compile(p) for p in (*spec.ignored_tensors, *ALWAYS_IGNORED)]
    unexpected = [n for n in reader.unused() if not any(p.search(n) for p in ignored)]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UnexpectedTensorError(
            f"checkpoint tensor {unexpected[0]} is not used by the {spec.model_type} architecture{more}"
        )


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this spec holds, in the canonical per-expert layout: name → shape.

    Computed by walking the same loader over a recorder, so it can never disagree with ``load_weights``.
    """
    recorder = ShapeRecorder()
    walk_weights(spec, recorder, None)
    return recorder.shapes


class ShapeRecorder(TensorLoader):
    """A loader that records the (name, shape) it is asked for and returns empty meta tensors; a subclass that
    overrides ``take``/``experts`` synthesizes weights with the loader's exact names and shapes (no checkpoint)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtype, self.device = torch.float32, "meta"

    def mark_used(self, name: str) -> None:
        pass

    def stored_shape(self, name: str) -> tuple[int, ...] | None:
        return None

    def stored_under(self, prefix: str) -> list[str]:
        return []

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        self.shapes[name] = shape
        return torch.empty(shape, device="meta")

    def take_ids(self, name: str, shape: tuple[int, ...], limit: int) -> torch.Tensor:
        return self.take(name, shape, torch.int64)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return None

    def experts(self, prefix: str, m: MoESpec, names: WeightNames, d: int) -> TorchExperts:
        leaves = (("gate_proj", (m.intermediate, d)),) if m.gated else ()
        for e in range(m.num_experts):
            for leaf, shape in (*leaves, ("up_proj", (m.intermediate, d)), ("down_proj", (d, m.intermediate))):
                self.take(f"{prefix}.experts.{e}.{leaf}.weight", shape)
        meta = torch.empty(0, device="meta")
        return TorchExperts(m, meta, meta)


def walk_weights(spec: ModelSpec, ld: TensorLoader,
                 on_layer: "callable | None") -> ModelWeights:  # type: ignore[valid-type]
    """Every tensor ``spec`` needs, taken from ``ld`` (a reader-backed ``TensorLoader``, or one that records, maps or
    synthesizes them), assembled into ``ModelWeights``; ``on_layer(i, layer_weights)`` after each layer."""
    ld.norm_offset = spec.norm_weight_offset
    d, v = spec.hidden_size, spec.vocab_size
    embed = ld.take(f"{spec.names.embed}.weight", (v, d))
    layers: list[LayerWeights] = []
    loaded: dict[str, tuple[LayerSpec, LayerWeights, int]] = {}
    for i, layer in enumerate(spec.layers):
        p = layer.prefix or f"{spec.names.layers}.{i}"
        n = layer.names or spec.names
        ld.layer = i
        again = loaded.get(p)
        if again is not None and replace(again[0], prefix=None) == replace(layer, prefix=None):
            layers.append(again[1])  # a layer visited again (Inkling 2's loop) shares its weights
            ld.share_layer(i, again[2])
            continue
        roles = {"attn_in": n.attn_in_norm, "attn_out": n.attn_out_norm, "ffn_in": n.ffn_in_norm,
                 "ffn_out": n.ffn_out_norm}
        wanted = {"both": roles, "mixer": ("attn_in", "attn_out"), "ffn": ("ffn_in", "ffn_out")}[layer.parts]
        norm_names = {role: name for role, name in roles.items() if name and role in wanted}
        gated = {role for role in n.gated_norm_roles if role in norm_names}
        lw = LayerWeights(
            norms={role: ld.norm(f"{p}.{name}{'.norm' if role in gated else ''}.weight", d)
                   for role, name in norm_names.items()},
            attn={} if layer.parts == "ffn"
            else ld.recurrent(f"{p}.{n.recurrent}", layer.recurrent, d) if layer.recurrent is not None
            else ld.attention(f"{p}.{n.attn}", layer.attention, d, n),
        )
        for role in gated:
            down = ld.stored_shape(f"{p}.{norm_names[role]}.W_down.weight")
            rank = down[0] if down else 1
            lw.norms[f"{role}_gate_down"] = ld.take(f"{p}.{norm_names[role]}.W_down.weight", (rank, d))
            lw.norms[f"{role}_gate_up"] = ld.take(f"{p}.{norm_names[role]}.W_up.weight", (d, rank))
        if spec.hyper_streams and spec.hyper_sinkhorn_iters:  # DeepSeek-V4: pre, post and an N x N mix
            nd, n3 = spec.hyper_streams * d, (2 + spec.hyper_streams) * spec.hyper_streams
            for role, sub in (("hc_mix", "hc_attn"), ("hc_ffn", "hc_ffn")):
                lw.norms[f"{role}_fn"] = ld.take(f"{p}.{sub}_fn", (n3, nd), torch.float32)
                lw.norms[f"{role}_base"] = ld.take(f"{p}.{sub}_base", (n3,), torch.float32)
                lw.norms[f"{role}_scale"] = ld.take(f"{p}.{sub}_scale", (3,), torch.float32)
        elif spec.hyper_streams:
            nd, n2 = spec.hyper_streams * d, 2 * spec.hyper_streams
            for role, sub in (("hc_mix", "hc_attn_layer"), ("hc_ffn", "hc_mlp_layer")):
                base = f"{p}.hc_pre.{sub}"
                lw.norms[f"{role}_fn"] = ld.take(f"{base}.hc_fn", (n2, nd), torch.float32)
                lw.norms[f"{role}_base"] = ld.take(f"{base}.hc_base", (n2,), torch.float32)
                lw.norms[f"{role}_scale"] = ld.take(f"{base}.hc_scale", (2,), torch.float32)
        if n.residual_weights and layer.parts == "both":
            lw.norms["res_mix"] = ld.take(f"{p}.{n.residual_weights[0]}", (d,))
            lw.norms["res_ffn"] = ld.take(f"{p}.{n.residual_weights[1]}", (d,))
        for e in layer.extras:
            lw.norms[e.name] = ld.take(f"{p}.{e.name}", e.shape, torch.float32 if e.fp32 else None)
        if layer.ple is not None and spec.gated_hyper is not None:  # Qwen4-Exp's per-layer n-gram embeddings
            lw.norms.update({f"ple.{k}": t for k, t in ple_weights(ld, f"{p}.ple", layer.ple, d,
                                                                   spec.gated_hyper.streams).items()})
        if n.residual_gates:  # Ergo: sigmoid(w)·f + sqrt(1 + sigmoid(w))·exp(-softplus(w)/2)·h as an affine residual
            for role, name in zip(("affine_mix", "affine_ffn"), n.residual_gates):
                w = ld.take(f"{p}.{name}.weight", (d,), torch.float32)
                gate = torch.sigmoid(w)
                zero = torch.zeros_like(w)
                keep = torch.sqrt(1.0 + gate) * torch.exp(-0.5 * F.softplus(w))  # computed in fp32, stored as the
                parts = {"hidden_states_scale": gate, "hidden_states_bias": zero,  # other residual weights are
                         "residual_scale": keep, "residual_bias": zero}
                lw.norms.update({f"{role}.{leaf}": t.to(ld.dtype) for leaf, t in parts.items()})
        if n.residual_affine:  # ZAYA: (f + b_f)·s_f + (h + b_h)·s_h per sub-layer
            for role, name in zip(("affine_mix", "affine_ffn"), n.residual_affine):
                for leaf in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
                    lw.norms[f"{role}.{leaf}"] = ld.take(f"{p}.{name}.{leaf}", (d,))
        for role, name in n.layer_norms:  # Gemma 4's norms of the MLP and MoE outputs and the MoE input
            lw.norms[role] = ld.norm(f"{p}.{name}.weight", d)
        if spec.per_layer_input:  # Gemma 4: the gate of the per-layer input, and the layer's output scale
            pd = spec.per_layer_input
            lw.norms["ple_gate"] = ld.take(f"{p}.per_layer_input_gate.weight", (pd, d))
            lw.norms["ple_proj"] = ld.take(f"{p}.per_layer_projection.weight", (d, pd))
            lw.norms["ple_norm"] = ld.norm(f"{p}.post_per_layer_input_norm.weight", d)
            lw.norms.update(ld.activation(per_layer_activation(layer), p, key="ple_act"))
        if n.layer_scalar:
            lw.norms["layer_scalar"] = ld.take(f"{p}.{n.layer_scalar}", (1,))
        if layer.post_conv:  # Inkling's residual convolutions on the mixer and FFN outputs (fp32, [D, 1, K])
            for role, name in zip(("conv_mix", "conv_ffn"), n.post_convs):
                lw.norms[role] = ld.take(f"{p}.{name}.conv1d.weight", (d, 1, layer.post_conv), torch.float32)
        if spec.norm_bias:
            lw.norms.update({f"{role}_bias": ld.take(f"{p}.{name}.bias", (d,)) for role, name in norm_names.items()})
        if layer.parts != "mixer":
            if layer.moe is not None:
                lw.moe = ld.moe(f"{p}.{n.moe_prefix}", layer, spec, p)
            if layer.mlp is not None and (layer.moe is None or layer.moe_shortcut == "compute" or layer.moe_beside_mlp):
                lw.mlp = ld.mlp(f"{p}.{n.mlp}", layer.mlp, d)
        layers.append(lw)
        loaded[p] = (layer, lw, i)
        if on_layer is not None:
            on_layer(i)
    norm = ld.norm(f"{spec.names.final_norm}.weight", d) if spec.names.final_norm else None
    head_name = spec.names.lm_head
    if spec.tie_embeddings:
        lm_head = embed
        ld.mark_used(f"{head_name}.weight")  # some exporters store the tied copy anyway
    elif spec.lm_head_rows is not None and spec.lm_head_rows != v:  # stored padded to the vocab or not
        rows = spec.lm_head_rows
        stored = ld.stored_shape(f"{head_name}.weight")
        lm_head = ld.take(f"{head_name}.weight", (v if stored == (v, d) else rows, d))[:rows].contiguous()
    else:
        lm_head = ld.take(f"{head_name}.weight", (v, d))
    lm_head_bias = ld.take(f"{head_name}.bias", (v,)) if spec.lm_head_bias else None
    norm_bias = ld.take(f"{spec.names.final_norm}.bias", (d,)) if spec.norm_bias else None
    head: dict[str, torch.Tensor] = {}
    if spec.hyper_streams:
        s_ = spec.hyper_streams
        base = "model.hc_head.hc_" if spec.hyper_sinkhorn_iters else "model.hc_pre.hc_head.hc_head_"  # V4 / HY-V4
        head = {"fn": ld.take(f"{base}fn", (s_, s_ * d), torch.float32),
                "base": ld.take(f"{base}base", (s_,), torch.float32),
                "scale": ld.take(f"{base}scale", (1,), torch.float32)}
    embed_norm = ld.norm(f"{spec.names.embed_norm}.weight", d) if spec.names.embed_norm else None
    extras = {e.name: ld.take(e.name, e.shape, torch.float32 if e.fp32 else None) for e in spec.extras}
    if spec.names.embed_affine:
        extras["embed_scale"] = ld.take(f"{spec.names.embed_affine}_scale", (d,))
        extras["embed_bias"] = ld.take(f"{spec.names.embed_affine}_bias", (d,))
    per_layer: dict[str, torch.Tensor] = {}
    if spec.per_layer_input:
        lp = spec.num_layers * spec.per_layer_input
        per_layer = {"embed": ld.take("model.embed_tokens_per_layer.weight", (spec.per_layer_vocab, lp)),
                     "projection": ld.take("model.per_layer_model_projection.weight", (lp, d)),
                     "norm": ld.norm("model.per_layer_projection_norm.weight", spec.per_layer_input)}
    return ModelWeights(embed, norm, lm_head, lm_head_bias, layers, norm_bias, head, embed_norm, extras, per_layer)
