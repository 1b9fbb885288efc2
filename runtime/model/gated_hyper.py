"""Qwen4-Exp's layer loop: gated-residual hyper-connections over N streams, per-layer n-gram embeddings, Gated
DeltaNet and query-selected attention mixers, MoE FFNs.

Legend: T tokens (every sequence of the batch), N streams, D hidden, R gate rank. The streams live side by side as
one [T, N·D] tensor. Each sub-layer (mixer, FFN):
  u = (1 + w)-RMSNorm of each stream;  g = sigmoid(up(silu(down(u) / N)))  [T, N·D]
  x = mean over streams of g · u  [T, D];   y = sublayer(x)
  streams += y injected into stream k with weight 2·sigmoid(inject(u)_k / N)
PLE layers first add their n-gram embeddings to the streams; after the last layer a gate of the same form (without
injection) mixes the streams into the hidden state the head reads (there is no final norm).
Per sequence, a PLE layer's state is (Gated DeltaNet conv, recurrence, n-gram context, PLE conv inputs) — slots of
the layer's one recurrent state (``conv_states.SlotView``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.model.conv_states import SlotView
from freetoken_agent.runtime.model.layers import elementwise, mixer_linear
from freetoken_agent.runtime.model.mixers.gated_deltanet import gated_deltanet
from freetoken_agent.runtime.model.ngram import group_norm, ple
from freetoken_agent.runtime.model.qsa import qsa_attention

Weights = dict[str, torch.Tensor]
FINAL_MIX = "model.hyper_connection_mixer"
SUBLAYERS = ("attn_hyper_connection", "mlp_hyper_connection")


def hyper_read(streams: torch.Tensor, w: Weights, name: str, n: int, d: int, eps: float,
               inject: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [T, N·D] → (the sub-layer input [T, D], injection weights [T, N] or None)."""
    u = group_norm(streams, w[f"{name}.hc_norm.weight"], d, eps)
    g = elementwise(F.silu, mixer_linear(u, w[f"{name}.input_mix_weight_down.weight"]) / n)
    g = elementwise(torch.sigmoid, mixer_linear(g, w[f"{name}.input_mix_weight_up.weight"]))
    x = (g.unflatten(-1, (n, d)) * u.unflatten(-1, (n, d))).mean(dim=-2)
    if not inject:
        return x, None
    return x, 2 * elementwise(torch.sigmoid, mixer_linear(u, w[f"{name}.block_inject_weight.weight"]) / n)


class GatedHyperRunner:
    """One batched forward of a ``gated_hyper`` spec (built per forward by ``Decoder.forward_batch``)."""

    def __init__(self, decoder: Any, segments: list, token_ids: torch.Tensor) -> None:
        self.dec, self.segments, self.ids = decoder, segments, token_ids
        self.spec = decoder.spec
        self.n, self.d, self.eps = decoder.spec.gated_hyper.streams, decoder.spec.hidden_size, decoder.spec.norm_eps

    def run(self, h: torch.Tensor) -> torch.Tensor:
        """Embeddings h [T, D] → the mixed hidden state [T, D] the head reads."""
        n, d, eps = self.n, self.d, self.eps
        streams = h.repeat(1, n)  # [T, N·D]
        for i, (layer, lw) in enumerate(zip(self.spec.layers, self.dec.weights.layers)):
            w = lw.norms
            if layer.ple is not None:
                streams = streams + self._per_sequence(i, streams, self._ple)
            x, inject = hyper_read(streams, w, SUBLAYERS[0], n, d, eps)
            y = self._per_sequence(i, x, self._mixer)
            streams = streams + (y[:, None, :] * inject[..., None]).flatten(-2)
            x, inject = hyper_read(streams, w, SUBLAYERS[1], n, d, eps)
            y = self.dec.ffn(i, x)
            streams = streams + (y[:, None, :] * inject[..., None]).flatten(-2)
        return hyper_read(streams, self.dec.weights.extras, FINAL_MIX, n, d, eps, inject=False)[0]

    def _per_sequence(self, i: int, x: torch.Tensor, fn: Any) -> torch.Tensor:
        return torch.cat([fn(i, x[s.start : s.end], s) for s in self.segments])

    def _mixer(self, i: int, x: torch.Tensor, seg: Any) -> torch.Tensor:
        layer, lw = self.spec.layers[i], self.dec.weights.layers[i]
        if layer.recurrent is not None:  # a PLE layer's Gated DeltaNet keeps its two tensors in slots 0-1
            view = SlotView(seg.cache, seg.scratch, 0, 2) if layer.ple is not None else seg.cache
            return gated_deltanet(x, lw.attn, layer.recurrent, i, view, self.eps)
        return qsa_attention(x, lw.attn, lw.norms, layer.attention, self.dec.rotary[i], i, seg.cache, seg.positions,
                             self.eps)

    def _ple(self, i: int, streams: torch.Tensor, seg: Any) -> torch.Tensor:
        layer, w = self.spec.layers[i], self.dec.weights.layers[i].norms
        view = SlotView(seg.cache, seg.scratch, 2, 2)
        state = view.get_state(i)
        table = {k.removeprefix("ple."): t for k, t in w.items() if k.startswith("ple.")}
        out, new_state = ple(streams, self.ids[seg.start : seg.end], table, layer.ple, self.d, self.eps, state)
        view.set_state(i, *new_state)
        return out
