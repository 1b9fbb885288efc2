"""The generic decoder: executes any ``ModelSpec`` (one code path for every architecture).

Legend: T new tokens (of every sequence in the batch, concatenated), D hidden, V vocab.

``forward_batch`` is the one code path that runs the layers (``ModelRunner`` in ``runtime/runner.py`` is its only
caller besides tests and ``forward``): a ragged batch of sequences, each with its own cache and a chunk of new tokens
(a prefill chunk or one decode token). Token-wise work (embedding, norms, MLPs, router, experts, multipliers) runs
once over all T rows — the MoE layer groups every row of the batch by expert, so each selected expert is read once
per step; token mixers (attention over a sequence's own KV, recurrent states) run per sequence on its slice.
Positions of a sequence continue from its cache's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import NamedTuple

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.attn_residual import AttnResidualRunner
from freetoken_agent.runtime.model.cca import cca_attention
from freetoken_agent.runtime.model.gated_hyper import GatedHyperRunner
from freetoken_agent.runtime.model.mlp_router import mlp_route
from freetoken_agent.runtime.model.conv_states import FFN, MIXER, slot_conv
from freetoken_agent.runtime.model.activations import activation_fn, params_in
from freetoken_agent.runtime.model.compressed import shared_kv_attention
from freetoken_agent.runtime.model.indexed import indexed_attention
from freetoken_agent.runtime.model.fused import FusedDecode
from freetoken_agent.runtime.model.gemma import (
    per_layer_activation,
    per_layer_inputs,
    per_layer_residual,
    reused_kv_attention,
    router_input,
)
from freetoken_agent.runtime.model.hyper import hc_head, hc_post, hc_pre
from freetoken_agent.runtime.model.mhc import mhc_post, mhc_pre
from freetoken_agent.runtime.model.layers import (
    Span,
    dense_linear,
    elementwise,
    gqa_attention,
    layer_norm,
    linear,
    mla_attention,
    mlp,
    rms_norm,
)
from freetoken_agent.runtime.model.mixers.gated_deltanet import gated_deltanet, kimi_delta
from freetoken_agent.runtime.model.mixers.lightning import lightning
from freetoken_agent.runtime.model.mixers.mamba import mamba
from freetoken_agent.runtime.model.mixers.mamba2 import mamba2
from freetoken_agent.runtime.model.mixers.moa import moa_attention
from freetoken_agent.runtime.model.mixers.short_conv import short_conv
from freetoken_agent.runtime.model.moe import ExpertsBackend, route
from freetoken_agent.runtime.model.relpos import relpos_attention, residual_conv
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.shared_sink import sink_route, stacked_shared
from freetoken_agent.runtime.model.spec import ModelSpec
from freetoken_agent.runtime.model.weights import LayerWeights, ModelWeights, MoEWeights


MIXERS = {"gated_deltanet": gated_deltanet, "short_conv": short_conv, "mamba2": mamba2, "mamba": mamba,
          "lightning": lightning, "kda": kimi_delta}
"""Recurrent mixer kind → ``fn(x, weights, spec, layer, cache, eps) -> [T, D]``."""


class Segment(NamedTuple):
    """One sequence's rows ``[start, end)`` of a batched forward, its cache and its positions [end - start]."""

    start: int
    end: int
    cache: KVCache
    positions: torch.Tensor
    scratch: dict
    """Per-forward values this sequence's layers share (sparse-attention indices)."""
    decode: bool = False
    """The rows are one decode token and its speculative drafts: each computed as its own decode step would be."""


class Decoder:
    """Runs the forward pass of a spec over loaded weights."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, device: torch.device | str = "cpu") -> None:
        self.spec, self.weights, self.device = spec, weights, torch.device(device)
        # Layers with the same rope share one table.
        tables: dict[object, Rotary] = {}
        self.rotary: list[Rotary | None] = []
        for layer in spec.layers:
            rope = layer.attention.rope
            if rope is not None and rope not in tables:
                tables[rope] = Rotary(rope, self.device)
            self.rotary.append(tables[rope] if rope is not None else None)
        self.experts: list[ExpertsBackend | None] = [
            lw.moe.experts if lw.moe is not None else None for lw in weights.layers
        ]
        """Per layer, the backend computing routed experts (replaceable: quantized, residency-managed)."""
        self._recurrent = spec.state_layers()  # layers with a per-sequence state (recurrent mixers, convolutions)
        self.routing_observers: list = []
        """Callables ``(layer, topk_ids [T, K])`` told of every routing decision (heat, profiles)."""
        self.fused = FusedDecode(spec, weights, self.rotary, self.experts, self.routing_observers)
        """A decode step's layers as one C call each (attention half, router, and the routing and experts where the
        backend allows) where the op-by-op path would run them all on the kernels (``model/fused.py``); bitwise the
        same hidden states."""

    def new_cache(self) -> KVCache:
        return KVCache(self.spec.num_layers)

    def forward(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """token_ids [T] of one sequence → final hidden states [T, D] (after the final norm); appends to ``cache``."""
        return self.forward_batch([token_ids], [cache])

    @torch.inference_mode()
    def forward_batch(self, token_ids: list[torch.Tensor], caches: list[KVCache],
                      rope_lengths: list[int | None] | None = None,
                      decode_rows: list[bool] | None = None) -> torch.Tensor:
        """Chunks token_ids[b] [T_b] of sequences b → final hidden states [ΣT_b, D], rows in batch order.

        Each chunk is appended to ``caches[b]`` (distinct caches) and its positions continue from that cache's length.
        ``rope_lengths[b]``: the whole known length of sequence b (a chunked prefill's prompt), which length-dependent
        rotary embeddings (dynamic NTK, longrope) turn by, as one forward of it would; None: the chunk's own end.
        ``decode_rows[b]``: chunk b is a decode token and its speculative drafts (a verify row), whose tokens must
        each come out as their own decode steps would — where a layer computes a prefill chunk another way
        (sparse attention's key selection), it then takes the decode steps' way.
        """
        if len(token_ids) != len(caches) or not token_ids:
            raise ValueError("forward_batch takes one cache per chunk, and at least one chunk")
        spec, w = self.spec, self.weights
        segments, start = [], 0
        decode_rows = decode_rows or [False] * len(token_ids)
        for ids, cache, decode in zip(token_ids, caches, decode_rows):
            for i in self._recurrent:  # fail before touching any cache if a recurrent state is not at cache.length
                cache.get_state(i)
            n = int(ids.shape[0])
            positions = torch.arange(cache.length, cache.length + n, device=self.device)
            segments.append(Segment(start, start + n, cache, positions, {}, decode))
            start += n
        self._batch_scratch: dict = {}  # per-forward values of the whole batch (the MoE shortcut)
        self._segments = segments  # the few token-mixing FFNs (product-key MoE) run per sequence
        self._batch_positions = torch.cat([s.positions for s in segments]) if len(segments) > 1 else None
        floors = [int(n or 0) for n in (rope_lengths or [None] * len(segments))]
        for rotary in {id(r): r for r in self.rotary if r is not None}.values():
            rotary.prime([s.positions for s in segments], floors, self._batch_positions)
        flat = token_ids[0] if len(token_ids) == 1 else torch.cat(token_ids)
        self._token_ids = flat.to(self.device)  # [T]: hash-routed MoE layers choose experts by token id
        h = F.embedding(self._token_ids, w.embed)
        if w.embed_norm is not None:
            h = rms_norm(h, w.embed_norm, spec.norm_eps)
        if "embed_scale" in w.extras:  # ZAYA: a per-channel affine map of the embeddings
            h = (h + w.extras["embed_bias"]) * w.extras["embed_scale"]
        if spec.embedding_multiplier != 1.0:
            h = h * spec.embedding_multiplier
        per_layer = per_layer_inputs(self._token_ids, h, w.per_layer, spec) if spec.per_layer_input else None
        if spec.hyper_streams:
            return self._forward_hyper(h, segments)
        if spec.attn_residual is not None or spec.gated_hyper is not None:  # Inkling 2, Qwen4-Exp: own layer loops
            runner = AttnResidualRunner(self, segments) if spec.attn_residual else GatedHyperRunner(self, segments, flat)
            h = runner.run(h)
            for seg in segments:
                seg.cache.advance()
            return h
        fused = self.fused.step(h, segments[0].cache, segments[0].positions) if len(segments) == 1 else None
        done = 0  # layers run by a multi-layer call (FusedStep.layers) up to here
        for i, (layer, lw) in enumerate(zip(spec.layers, w.layers)):
            if i < done:
                continue
            if fused is not None and (ran := fused.layers(i, h)):  # layers i.. whole, in one C call
                done = i + ran
                continue
            if fused is not None and (got := fused.attention(i, h)) is not None:  # the layer in one C call
                if got[0] is not None:  # the FFN op by op (the call ran it when it returns no input for it)
                    h.add_(self._ffn(i, got[0], lw, logits=got[1]))  # plan_layer admits only an FFN added back as is
                continue
            if spec.parallel_block:
                x = self._norm(h, lw, "attn_in")
                h = h + self._mixer(i, x, lw, segments) + self._ffn(i, x, lw)
                continue
            if layer.parts != "ffn":
                h = self._mix(i, h, lw, segments)
            if layer.parts != "mixer":
                x = self._norm(h, lw, "ffn_in")
                if spec.residual_from_norm:
                    h = x
                if "res_ffn" in lw.norms:
                    h = h * lw.norms["res_ffn"]
                x = self._ffn(i, x, lw, h)
                if layer.post_conv:
                    x = self._post_conv(i, x, lw, FFN)
                x = self._norm(x, lw, "ffn_out")
                h = self._residual(h, x, layer.residual_scales[2:], lw, "affine_ffn")
            if layer.moe_shortcut == "add":
                h = h + self._batch_scratch.pop("moe_shortcut")
            if per_layer is not None or "layer_scalar" in lw.norms:  # Gemma 4
                act = activation_fn("linear")  # unused without per-layer inputs
                if per_layer is not None:
                    act = activation_fn(per_layer_activation(layer), params_in(lw.norms, "ple_act"))
                h = per_layer_residual(h, None if per_layer is None else per_layer[:, i], lw.norms, act, spec.norm_eps)
        for seg in segments:
            seg.cache.advance()
        return self._norm(h, None, "final")

    def _forward_hyper(self, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Hyper-connection variant of the layer loop: N residual streams instead of one."""
        spec = self.spec
        streams = h[:, None, :].expand(-1, spec.hyper_streams, -1).contiguous()  # [T, N, D]
        for i, lw in enumerate(self.weights.layers):
            for role, norm in (("hc_mix", "attn_in"), ("hc_ffn", "ffn_in")):
                hc = {k: lw.norms[f"{role}_{k}"] for k in ("fn", "base", "scale")}
                if spec.hyper_sinkhorn_iters:  # manifold-constrained: the streams are mixed too (DeepSeek-V4)
                    post, comb, x = mhc_pre(streams, hc, spec.hyper_sinkhorn_iters, spec.hyper_magnitude,
                                            spec.hyper_eps, spec.norm_eps)
                else:
                    post, x = hc_pre(streams, hc, spec.hyper_magnitude, spec.hyper_eps, spec.norm_eps)
                x = self._norm(x, lw, norm)
                x = self._mixer(i, x, lw, segments) if role == "hc_mix" else self._ffn(i, x, lw)
                streams = mhc_post(streams, post, comb, x) if spec.hyper_sinkhorn_iters else hc_post(streams, post, x)
        for seg in segments:
            seg.cache.advance()
        h = hc_head(streams, self.weights.hyper_head, spec.hyper_eps, spec.norm_eps)
        return self._norm(h, None, "final")

    def _mix(self, i: int, h: torch.Tensor, lw: LayerWeights, segments: list[Segment]) -> torch.Tensor:
        """Token-mixing half of layer ``i`` (attention or a recurrent mixer) with its norms and residual."""
        normed = self._norm(h, lw, "attn_in")
        x = self._mixer(i, normed, lw, segments)
        if self.spec.layers[i].post_conv:
            x = self._post_conv(i, x, lw, MIXER)
        x = self._norm(x, lw, "attn_out")
        base = normed if self.spec.residual_from_norm else h
        if "res_mix" in lw.norms:
            base = base * lw.norms["res_mix"]
        return self._residual(base, x, self.spec.layers[i].residual_scales[:2], lw, "affine_mix")

    def _post_conv(self, i: int, x: torch.Tensor, lw: LayerWeights, slot: int) -> torch.Tensor:
        """Inkling's residual convolution over a sub-layer's output x [T, D], each sequence continuing its state."""
        conv = residual_conv(lw.norms["conv_mix" if slot == MIXER else "conv_ffn"], 1.0)
        return torch.cat([slot_conv(x[s.start : s.end], s.cache, s.scratch, i, slot, conv) for s in self._segments])

    def _residual(self, h: torch.Tensor, x: torch.Tensor, scales: tuple[float, ...], lw: LayerWeights | None = None,
                  role: str = "") -> torch.Tensor:
        if lw is not None and f"{role}.residual_scale" in lw.norms:  # ZAYA's learned affine residual
            n = lw.norms
            return (x + n[f"{role}.hidden_states_bias"]) * n[f"{role}.hidden_states_scale"] + \
                (h + n[f"{role}.residual_bias"]) * n[f"{role}.residual_scale"]
        alpha, beta = scales
        beta *= self.spec.residual_multiplier
        return (h if alpha == 1.0 else h * alpha) + (x if beta == 1.0 else x * beta)

    def _mixer(self, i: int, x: torch.Tensor, lw: LayerWeights, segments: list[Segment]) -> torch.Tensor:
        """x [T, D] of the whole batch → the mixer's output [T, D], each sequence over its own cache."""
        if len(segments) == 1:
            seg = segments[0]
            return self._mixer_one(i, x, lw, seg.cache, seg.positions, seg.scratch, seg.decode)
        spec, layer = self.spec, self.spec.layers[i]
        att = layer.attention
        batched = (att.kind in ("gqa", "mla", "shared_kv") and (att.kind != "mla" or att.indexer is None)
                   and att.sparse_index is None)
        if layer.recurrent is None and batched:
            # projections over every row at once (each weight read once per step), attention per sequence
            spans = [Span(s.start, s.end, s.cache, s.positions, s.decode) for s in segments]
            positions = self._batch_positions if self._batch_positions is not None else \
                torch.cat([s.positions for s in segments])
            if att.kv_source is not None:  # Gemma 4: queries over another layer's KV
                return reused_kv_attention(x, lw.attn, att, self.rotary[i], None, positions, spec.norm_eps, spans)
            fn = {"mla": mla_attention, "shared_kv": shared_kv_attention}.get(att.kind, gqa_attention)
            return fn(x, lw.attn, att, self.rotary[i], i, None, positions, spec.norm_eps, spans=spans)
        return torch.cat([self._mixer_one(i, x[s.start : s.end], lw, s.cache, s.positions, s.scratch, s.decode)
                          for s in segments])

    def _mixer_one(self, i: int, x: torch.Tensor, lw: LayerWeights, cache: KVCache, positions: torch.Tensor,
                   scratch: dict, decode: bool = False) -> torch.Tensor:
        spec, layer = self.spec, self.spec.layers[i]
        if layer.recurrent is not None:
            return MIXERS[layer.recurrent.kind](x, lw.attn, layer.recurrent, i, cache, spec.norm_eps)
        if layer.attention.kind == "cca":
            return cca_attention(x, lw.attn, layer.attention, self.rotary[i], i, cache, positions, scratch)
        if layer.attention.kind == "relpos":
            return relpos_attention(x, lw.attn, layer.attention, i, cache, positions, spec.norm_eps, scratch)
        if layer.attention.sparse_index is not None:  # Kolibri 1.1 (its own KV or another layer's)
            return indexed_attention(x, lw.attn, layer.attention, i, cache, positions, spec.norm_eps, scratch)
        if layer.attention.kv_source is not None:
            return reused_kv_attention(x, lw.attn, layer.attention, self.rotary[i], cache, positions, spec.norm_eps)
        if layer.attention.kind == "shared_kv":
            return shared_kv_attention(x, lw.attn, layer.attention, self.rotary[i], i, cache, positions, spec.norm_eps,
                                       decode_row=decode)
        if layer.attention.kind == "moa":
            return moa_attention(x, lw.attn, layer.attention, self.rotary[i], i, cache, positions, spec.norm_eps)
        if layer.attention.kind == "mla":
            return mla_attention(x, lw.attn, layer.attention, self.rotary[i], i, cache, positions, spec.norm_eps,
                                 scratch, decode_row=decode)
        return gqa_attention(x, lw.attn, layer.attention, self.rotary[i], i, cache, positions, spec.norm_eps)

    def _norm(self, x: torch.Tensor, lw: LayerWeights | None, role: str) -> torch.Tensor:
        """A residual-stream norm of the spec's kind (``role`` "final": the model's last norm)."""
        weight = self.weights.norm if lw is None else lw.norms.get(role)
        if weight is None:
            return x
        if self.spec.norm_kind == "layer":
            bias = self.weights.norm_bias if lw is None else lw.norms.get(f"{role}_bias")
            return layer_norm(x, weight, self.spec.norm_eps, bias)
        y = rms_norm(x, weight, self.spec.norm_eps)
        if lw is not None and f"{role}_gate_down" in lw.norms:  # gated RMSNorm (A.X K2)
            g = dense_linear(elementwise(F.silu, dense_linear(y, lw.norms[f"{role}_gate_down"])),
                             lw.norms[f"{role}_gate_up"])
            y = (y * elementwise(torch.sigmoid, g.float())).to(y.dtype)
        return y

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The FFN half of layer ``i`` over rows x [T, D] (dense MLP, or MoE through ``experts[i]``), for layer loops
        kept in their own module (``model/attn_residual.py``)."""
        return self._ffn(i, x, self.weights.layers[i])

    def _ffn(self, i: int, x: torch.Tensor, lw: LayerWeights, residual: torch.Tensor | None = None,
             logits: torch.Tensor | None = None) -> torch.Tensor:
        """``logits``: the router's product over x, already computed (the fused decode step)."""
        layer = self.spec.layers[i]
        if layer.moe_beside_mlp and lw.moe is not None and residual is not None:  # Gemma 4 (LayerSpec docstring)
            assert layer.mlp is not None and lw.mlp is not None
            routed = self._moe(i, self._norm(residual, lw, "moe_in"), lw.moe,
                               router_input(residual, lw.moe.router["scale"], self.spec.norm_eps))
            return self._norm(mlp(x, lw.mlp, layer.mlp), lw, "mlp_out") + self._norm(routed, lw, "moe_out")
        if layer.moe_shortcut == "compute" and lw.moe is not None:
            self._batch_scratch["moe_shortcut"] = self._moe(i, x, lw.moe)
        if lw.moe is None or layer.moe_shortcut == "compute":
            assert layer.mlp is not None and lw.mlp is not None
            return mlp(x, lw.mlp, layer.mlp)
        return self._moe(i, x, lw.moe, logits=logits)

    def _moe(self, i: int, x: torch.Tensor, mw: MoEWeights, router_x: torch.Tensor | None = None,
             logits: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE block over rows x [T, D]; ``router_x`` [T, D]: what the router sees, when not x (Gemma 4);
        ``logits``: the router's product over x, already computed (the fused decode step)."""
        moe = self.spec.layers[i].moe
        assert moe is not None
        if moe.kind == "product_key":  # its reference views the router logits across a sequence's tokens
            segs = self._segments
            if len(segs) == 1:
                return self._product_key_moe(i, x, mw)
            return torch.cat([self._product_key_moe(i, x[g.start : g.end], mw) for g in segs])
        gammas = None  # the shared experts' routing shares (Inkling's sink router)
        if moe.router.shared_sink:
            ids, weights, gammas = sink_route(x, moe, mw.router["weight"], mw.correction, mw.router.get("global_scale"))
        elif moe.router.mlp_hidden:  # ZAYA: its state flows from each MoE layer's router to the next
            ids, weights, state = mlp_route(x, mw.router, moe.top_k, moe.num_experts,
                                            self._batch_scratch.get("router_state"), self.spec.norm_eps)
            self._batch_scratch["router_state"] = state
        else:
            fixed = mw.router["tid2eid"][self._token_ids] if moe.router.hash_table else None  # [T, K]
            ids, weights = route(x if router_x is None else router_x, moe.router, moe.top_k, mw.router["weight"],
                                 mw.router.get("bias"), mw.correction, fixed, logits)
            if "expert_scale" in mw.router:  # a learned scale per expert on its routing weight (Gemma 4)
                weights = weights * mw.router["expert_scale"][ids]
        identity = None
        if moe.zero_experts:  # identity experts: weight · x, then hidden from the expert backend
            zero = ids >= moe.num_experts
            identity = x * (weights * zero).sum(dim=-1, keepdim=True).to(x.dtype)
            ids, weights = ids.masked_fill(zero, 0), weights.masked_fill(zero, 0.0)
        for observe in self.routing_observers:
            observe(i, ids)
        backend = self.experts[i]
        assert backend is not None
        weights = weights.to(x.dtype) if x.dtype != torch.float32 else weights
        xe = linear(x, mw.latent, "fc1_latent_proj") if moe.latent else x  # [T, L] in a latent MoE, else x
        if moe.scale_input:  # each chosen expert sees x scaled by its weight; outputs are summed unweighted
            ones = torch.ones_like(weights[:, :1])
            out = sum(backend.forward(xe * weights[:, k : k + 1], ids[:, k : k + 1], ones) for k in range(ids.shape[1]))
        elif mw.expert_norm is not None:  # Ergo: one route per row (weight 1: the expert's own output), its norm,
            t, k = ids.shape  # then the weighted sum
            routes = backend.forward(xe.repeat_interleave(k, dim=0), ids.reshape(-1, 1),
                                     torch.ones(t * k, 1, dtype=weights.dtype, device=weights.device))
            normed = F.rms_norm(routes.float(), routes.shape[-1:], None, self.spec.norm_eps)
            normed = (normed * mw.expert_norm[ids.reshape(-1)]).to(routes.dtype)
            out = (normed.view(t, k, -1) * weights[..., None]).sum(1).to(xe.dtype)
        else:
            out = backend.forward(xe, ids, weights)
        if moe.latent:
            out = linear(out, mw.latent, "fc2_latent_proj")  # [T, D]
        if identity is not None:
            out = out + identity
        if moe.shared is not None:
            shared = mlp(x, mw.shared, moe.shared) if gammas is None else stacked_shared(x, mw.shared, gammas, moe.shared)
            if mw.shared_gate is not None:
                shared = elementwise(torch.sigmoid, dense_linear(x, mw.shared_gate)) * shared
            if mw.shared_norm is not None:
                shared = rms_norm(shared, mw.shared_norm, self.spec.norm_eps)
            out = (out + shared) / 2 if moe.shared_average else out + shared
        if mw.output_bias is not None:
            out = out + mw.output_bias
        if mw.output_norm is not None:
            out = rms_norm(out, mw.output_norm, self.spec.norm_eps)
        return out

    def _product_key_moe(self, i: int, x: torch.Tensor, mw: MoEWeights) -> torch.Tensor:
        """Doge's cross-domain MoE: a product-key router over rank-1 experts, added to a dense gated MLP."""
        moe = self.spec.layers[i].moe
        assert moe is not None and moe.shared is not None
        t, keys = x.shape[0], int(moe.num_experts**0.5)
        logits = F.linear(x, mw.router["weight"]).reshape(2, t, keys)  # the reference's raw view, not a split
        (sx, sy), (ix, iy) = logits.topk(keys, dim=-1)
        scores = (sx[:, :, None] + sy[:, None, :]).reshape(t, -1)
        ids = (ix[:, :, None] * keys + iy[:, None, :]).reshape(t, -1)
        top, pos = scores.topk(moe.top_k, dim=-1)
        ids = ids.gather(-1, pos)
        weights = torch.softmax(top, dim=-1)
        if moe.router.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        for observe in self.routing_observers:
            observe(i, ids)
        act = activation_fn(moe.activation, params_in(mw.shared))  # one act_fn serves the MLP and the experts
        h = act(torch.einsum("tkd,td->tk", mw.router["down_embed"][ids], x)) * weights  # [T, K]
        routed = torch.einsum("tk,tkd->td", h, mw.router["up_embed"][ids])
        return mlp(x, mw.shared, moe.shared) + routed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [T, D] → logits [T, V] in fp32."""
        w = self.weights
        head = w.lm_head  # a QuantLinear with dense_quant (runtime/kernels/dense.py)
        if isinstance(head, torch.Tensor):
            out = dense_linear(hidden, head, w.lm_head_bias)
        else:
            out = head(hidden, w.lm_head_bias)
        out = out if out.dtype is torch.float32 else out.float()
        if self.spec.logits_divisor != 1.0:
            out = out / self.spec.logits_divisor
        if self.spec.final_logit_softcap > 0:
            cap = self.spec.final_logit_softcap
            out = torch.tanh(out / cap) * cap
        return out
