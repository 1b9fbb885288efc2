"""Inkling 2's layer loop: block attention residuals instead of a residual stream, optionally with looped layers.

Legend: T tokens (every sequence of the batch), D hidden, B saved block states, Q learned queries.

Each sub-layer reads its input as a softmax attention of learned queries over the unit-RMS-normalized block
states saved so far plus the running partial sum ("attention residual"); every ``block_layers``-th layer saves its
input as a new block state and restarts the partial sum from its attention output. Full-attention layers read three
inputs (query, key, value). Sub-layer outputs pass a residual short convolution ((x + conv(x)) / sqrt(K + 1)) whose
state is kept per sequence (``conv_states``). With a loop, layers ``loop_start..loop_end`` run ``loop_passes`` times:
each later pass restarts from the pre-loop states and gates its inputs with messages read from the previous pass's
blocks. Every visit of a layer has its own KV cache and conv states: ``ModelSpec.layers`` lists the visits (layers
0..N-1, then each extra pass's visits), their weights shared with the layer they repeat.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from freetoken_agent.runtime.model.conv_states import FFN, MIXER, slot_conv
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.layers import dense_linear, elementwise, mixer_linear, rms_norm, unit_rms_norm
from freetoken_agent.runtime.model.relpos import relpos_attention, residual_conv
from freetoken_agent.runtime.model.spec import AttnResidualSpec

Weights = dict[str, torch.Tensor]

# Names as Inkling 2 checkpoints store them (transformers renames them on load; we read the files as they are).
ROOT = "model.llm"
FINAL_QUERY = f"{ROOT}.attn_res.output_query"
MESSAGE_QUERIES = (f"{ROOT}.middle_cycle_cross_pass_queries", f"{ROOT}.middle_cycle_cross_pass_kv_queries")
"""Loop models: [2L, D] each — (query, MLP) and (key, value) message queries of each of the L loop layers."""
GATES = ("controllers.attn", "controllers.k", "controllers.v", "controllers.mlp")
"""Loop layers' message gates (``{gate}.down_weight`` [r, 2D], ``.forget_weight`` / ``.gain_weight`` [D, r]), in the
order of the four messages: query, key, value and MLP inputs."""
INPUT_NORMS = ("q_input_norm", "k_input_norm", "v_input_norm")
"""Full-attention layers' norms of their three inputs (sliding layers have one, ``attn_norm``)."""


def attn_query(layer: int) -> str:
    """The learned queries [D] (sliding) or [3, D] (full) of layer ``layer`` >= 1's attention input."""
    return f"{ROOT}.attn_res.attn_queries.{layer - 1}"


def mlp_query(layer: int) -> str:
    return f"{ROOT}.attn_res.mlp_queries.{layer}"


def block_read(blocks: list[torch.Tensor], partial: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Learned queries [Q, D] (or [D]) attending over blocks [T, D]… + partial [T, D] → [T, Q, D] in fp32."""
    stacked = unit_rms_norm(torch.stack([*blocks, partial], dim=1).float(), 1e-6)  # [T, B+1, D]
    q = query.float().reshape(-1, stacked.shape[-1])  # [Q, D]
    if not kops.deterministic():
        scores = torch.einsum("qd,tbd->tqb", q, stacked) * stacked.shape[-1] ** -0.5
        return torch.einsum("tqb,tbd->tqd", torch.softmax(scores, dim=-1), stacked)
    t, b, d = stacked.shape  # deterministic: fixed-order products per row, whatever T
    scores = dense_linear(stacked.reshape(t * b, d), q.contiguous()).view(t, b, -1).transpose(1, 2) * d**-0.5
    probs = torch.softmax(scores, dim=-1)  # [T, Q, B+1]
    out = probs[..., 0, None] * stacked[:, None, 0]
    for j in range(1, b):
        out = out + probs[..., j, None] * stacked[:, None, j]
    return out


def message_gate(h: torch.Tensor, message: torch.Tensor, w: Weights, name: str, eps: float) -> torch.Tensor:
    """(1 - tanh(F·g)) · h + tanh(M·g) · message with g = down([rms(h), rms(message)]), in fp32."""
    h, message = h.float(), message.float()
    g = mixer_linear(torch.cat([unit_rms_norm(h, eps), unit_rms_norm(message, eps)], dim=-1),
                     w[f"{name}.down_weight"])
    forget = elementwise(torch.tanh, mixer_linear(g, w[f"{name}.forget_weight"]))
    keep = elementwise(torch.tanh, mixer_linear(g, w[f"{name}.gain_weight"]))
    return (1 - forget) * h + keep * message


def _norm(x: torch.Tensor, w: Weights, name: str, eps: float, dtype: torch.dtype) -> torch.Tensor:
    return (w[f"{name}.weight"] * unit_rms_norm(x.float(), eps)).to(dtype)


class AttnResidualRunner:
    """One batched forward of an ``attn_residual`` spec (built per forward by ``Decoder.forward_batch``)."""

    def __init__(self, decoder: Any, segments: list) -> None:
        self.dec, self.segments = decoder, segments
        self.spec = decoder.spec
        self.ar: AttnResidualSpec = decoder.spec.attn_residual
        self.eps = decoder.spec.norm_eps

    def run(self, h: torch.Tensor) -> torch.Tensor:
        """Embeddings h [T, D] → final hidden states [T, D] (after the final norm)."""
        ar, dtype = self.ar, h.dtype
        blocks: list[torch.Tensor] = []
        n, span = ar.weight_layers, ar.loop_end - ar.loop_start
        looped = ar.loop_passes > 1 and span > 0
        first_stop = ar.loop_end if looped else n
        pre_h, pre_blocks = h, blocks
        for i in range(first_stop):
            if looped and i == ar.loop_start:  # later passes restart from here
                pre_h, pre_blocks = h, list(blocks)
            h = self._visit(i, i, h, blocks, None)
        if looped:
            for p in range(1, ar.loop_passes):
                previous = blocks[len(pre_blocks) + 1 :]  # the previous pass's blocks but its first (= pre_h)
                messages_from, h, blocks = h, pre_h, list(pre_blocks)
                for j in range(span):
                    messages = block_read(previous, messages_from, self._message_queries(j))  # [T, 4, D]
                    visit = n + (p - 1) * span + j
                    h = self._visit(visit, ar.loop_start + j, h, blocks, messages)
            for i in range(ar.loop_end, n):
                h = self._visit(i, i, h, blocks, None)
        h = block_read(blocks, h, self.dec.weights.extras[FINAL_QUERY])[:, 0]
        return rms_norm(h.to(dtype), self.dec.weights.norm, self.eps)

    def _message_queries(self, j: int) -> torch.Tensor:
        """Loop layer j's four message queries [4, D]: query, key, value, MLP."""
        qm, kv = (self.dec.weights.extras[name] for name in MESSAGE_QUERIES)
        return torch.stack([qm[2 * j], kv[2 * j], kv[2 * j + 1], qm[2 * j + 1]])

    def _visit(self, visit: int, layer: int, h: torch.Tensor, blocks: list[torch.Tensor],
               messages: torch.Tensor | None) -> torch.Tensor:
        """One layer visit: h [T, D] → [T, D]; appends h to ``blocks`` at a block boundary."""
        ar, dec, eps, dtype = self.ar, self.dec, self.eps, h.dtype
        w, extras = dec.weights.layers[visit].norms, dec.weights.extras
        boundary = layer % ar.block_layers == 0
        full = f"{INPUT_NORMS[0]}.weight" in w
        if layer > 0:
            reads = block_read(blocks, h, extras[attn_query(layer)]).unbind(1)  # 1 or 3 × [T, D]
        else:  # the first layer reads its input directly
            reads = (h.float(),)
        inputs = list(reads) * 3 if len(reads) == 1 else list(reads)
        if messages is not None:
            inputs = [message_gate(x, messages[:, k], w, gate, eps) for k, (x, gate) in enumerate(zip(inputs, GATES))]
        if full:
            q, k, v = (_norm(x, w, name, eps, dtype) for x, name in zip(inputs, INPUT_NORMS))
        elif messages is None:
            q = k = v = _norm(inputs[0], w, "attn_norm", eps, dtype)
        else:
            q, k, v = (_norm(x, w, "attn_norm", eps, dtype) for x in inputs)
        a = self._per_sequence(visit, q, k, v)
        a = self._conv(visit, a, w["attn_sconv.weight"], MIXER).float()
        local = [*blocks, h] if boundary else blocks
        residual = a if boundary else h.float() + a
        m = block_read(local, residual, extras[mlp_query(layer)])[:, 0]
        if messages is not None:
            m = message_gate(m, messages[:, 3], w, GATES[3], eps)
        m = dec.ffn(visit, _norm(m, w, "mlp_norm", eps, dtype))
        m = self._conv(visit, m, w["mlp_sconv.weight"], FFN)
        if boundary:
            blocks.append(h)
        return (residual + m.float()).to(dtype)

    def _per_sequence(self, visit: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The relative-position attention of each sequence over its own cache: [T, D] inputs → [T, D]."""
        spec, lw = self.spec.layers[visit].attention, self.dec.weights.layers[visit].attn
        return torch.cat([
            relpos_attention(q[s.start : s.end], lw, spec, visit, s.cache, s.positions, self.eps, s.scratch,
                             kx=k[s.start : s.end], vx=v[s.start : s.end])
            for s in self.segments
        ])

    def _conv(self, visit: int, x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor:
        conv = residual_conv(weight, math.sqrt(weight.shape[-1] + 1))
        return torch.cat([slot_conv(x[s.start : s.end], s.cache, s.scratch, visit, slot, conv)
                          for s in self.segments])
