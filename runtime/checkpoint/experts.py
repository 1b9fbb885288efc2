"""Normalize every on-disk expert layout into one shape per (layer, expert).

Layouts seen in the wild, all addressed here by ``(layer, expert)``:
- per-expert 2-D tensors: ``experts.{e}.gate_proj/up_proj/down_proj.weight`` or ``experts.{e}.w1/w3/w2.weight``;
- fused 3-D tensors: ``experts.gate_up_proj`` [E, 2I, D] + ``experts.down_proj`` [E, D, I] (transformers ≥5),
  Granite's ``input_linear.weight`` / ``output_linear.weight`` (same shapes);
- transposed fused: ``experts.gate_up_proj`` [E, D, 2I] (gate columns then up) + ``experts.down_proj`` [E, I, D];
  ungated (Ergo): ``experts.up_proj`` [E, D, I] + ``experts.down_proj`` [E, I, D];
- DBRX: ``experts.mlp.w1`` / ``v1`` / ``w2``, each [E·I, D] (gate, up, down transposed);
- GPT-OSS: ``experts.gate_up_proj`` [E, D, 2I] with gate/up interleaved by column, ``experts.down_proj`` [E, I, D],
  plus ``*_bias`` tensors.
Normalized form: gate_up [2I, D] (gate rows, then up rows) and down [D, I] per expert, optional biases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken_agent.runtime.checkpoint.reader import CheckpointReader
from freetoken_agent.runtime.errors import MissingTensorError, ShapeMismatchError
from freetoken_agent.runtime.model.spec import MoESpec, WeightNames

_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class ExpertTensors:
    """One expert's weights in the normalized layout."""

    gate_up: torch.Tensor  # [2I, D]
    down: torch.Tensor  # [D, I]
    gate_up_bias: torch.Tensor | None = None  # [2I]
    down_bias: torch.Tensor | None = None  # [D]


def _check(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> None:
    if name not in reader:
        raise MissingTensorError(f"missing tensor {name} (expected shape {list(shape)})")
    if reader.shape(name) != shape:
        raise ShapeMismatchError(f"tensor {name} has shape {list(reader.shape(name))}, expected {list(shape)}")


def _deinterleave_rows(w: torch.Tensor) -> torch.Tensor:
    """[2I, D] with rows gate_0, up_0, gate_1, ... → [2I, D] gate rows then up rows."""
    return torch.cat([w[0::2], w[1::2]], dim=0)


class ExpertSource:
    """Where the experts of one MoE layer live in a checkpoint; ``load(e)`` reads one expert, normalized."""

    def __init__(self, reader: CheckpointReader, prefix: str, moe: MoESpec, names: WeightNames, hidden: int) -> None:
        self.reader, self.prefix, self.moe = reader, prefix, moe
        e, i, d = moe.num_experts, moe.intermediate, hidden
        if not moe.gated:  # up [E, I, D] + down [E, D, I]; the normalized gate_up holds only the up rows
            up, dn = (f"{prefix}.{n}" for n in names.fused_names)
            if up in reader and names.gate_up_layout == "concat_transposed":  # up [E, D, I] + down [E, I, D] (Ergo)
                _check(reader, up, (e, d, i))
                _check(reader, dn, (e, i, d))
                self._load = lambda k: ExpertTensors(reader.get_row(up, k).T, reader.get_row(dn, k).T)
                self.layout = "fused-ungated-transposed"
            elif up in reader:
                _check(reader, up, (e, i, d))
                _check(reader, dn, (e, d, i))
                self._load = lambda k: ExpertTensors(reader.get_row(up, k), reader.get_row(dn, k))
                self.layout = "fused-ungated"
            else:
                for k in range(e):
                    _check(reader, f"{prefix}.experts.{k}.up_proj.weight", (i, d))
                    _check(reader, f"{prefix}.experts.{k}.down_proj.weight", (d, i))
                self._load = lambda k: ExpertTensors(*(reader.get(f"{prefix}.experts.{k}.{leaf}.weight")
                                                       for leaf in ("up_proj", "down_proj")))
                self.layout = "per-expert-ungated"
            return
        self._load: Callable[[int], ExpertTensors]
        if names.gate_up_layout == "dbrx":
            w1, v1, w2 = (f"{prefix}.experts.mlp.{n}" for n in ("w1", "v1", "w2"))
            for name in (w1, v1, w2):
                _check(reader, name, (e * i, d))
            rows = lambda name, k: reader.get_rows(name, k * i, (k + 1) * i)  # noqa: E731
            self._load = lambda k: ExpertTensors(torch.cat([rows(w1, k), rows(v1, k)]), rows(w2, k).T)
            self.layout = "dbrx"
            return
        fused = [names.fused_names, ("experts.gate_up_proj", "experts.down_proj")]
        fused_found = next((f for f in fused if f"{prefix}.{f[0]}" in reader), None)
        if fused_found and names.gate_up_layout == "interleaved_transposed":
            gu, dn = (f"{prefix}.{n}" for n in fused_found)
            _check(reader, gu, (e, d, 2 * i))
            _check(reader, dn, (e, i, d))
            biases = (f"{gu}_bias", f"{dn}_bias") if moe.expert_bias else None
            if biases:
                _check(reader, biases[0], (e, 2 * i))
                _check(reader, biases[1], (e, d))
            self._load = lambda k: self._interleaved(gu, dn, biases, k)
            self.layout = "fused-interleaved"
        elif fused_found and names.gate_up_layout == "interleaved":  # [E, 2I, D], rows alternate gate/up (Inkling 2)
            gu, dn = (f"{prefix}.{n}" for n in fused_found)
            _check(reader, gu, (e, 2 * i, d))
            _check(reader, dn, (e, d, i))
            self._load = lambda k: ExpertTensors(_deinterleave_rows(reader.get_row(gu, k)), reader.get_row(dn, k))
            self.layout = "fused-interleaved-rows"
        elif fused_found and names.gate_up_layout == "concat_transposed":
            gu, dn = (f"{prefix}.{n}" for n in fused_found)
            _check(reader, gu, (e, d, 2 * i))
            _check(reader, dn, (e, i, d))
            self._load = lambda k: ExpertTensors(reader.get_row(gu, k).T, reader.get_row(dn, k).T)
            self.layout = "fused-transposed"
        elif fused_found:
            gu, dn = (f"{prefix}.{n}" for n in fused_found)
            _check(reader, gu, (e, 2 * i, d))
            _check(reader, dn, (e, d, i))
            self._load = lambda k: ExpertTensors(reader.get_row(gu, k), reader.get_row(dn, k))
            self.layout = "fused"
        else:
            style = next((s for s in _PER_EXPERT if f"{prefix}.experts.0.{s[0]}.weight" in reader), _PER_EXPERT[0])
            for k in range(e):
                base = f"{prefix}.experts.{k}"
                _check(reader, f"{base}.{style[0]}.weight", (i, d))
                _check(reader, f"{base}.{style[1]}.weight", (i, d))
                _check(reader, f"{base}.{style[2]}.weight", (d, i))
            self._load = lambda k: self._per_expert(style, k)
            self.layout = "per-expert"

    def _per_expert(self, style: tuple[str, str, str], k: int) -> ExpertTensors:
        base = f"{self.prefix}.experts.{k}"
        gate, up, down = (self.reader.get(f"{base}.{n}.weight") for n in style)
        return ExpertTensors(torch.cat([gate, up], dim=0), down)

    def _interleaved(self, gu: str, dn: str, biases: tuple[str, str] | None, k: int) -> ExpertTensors:
        w = self.reader.get_row(gu, k)  # [D, 2I], columns alternate gate/up
        gate_up = torch.cat([w[:, 0::2].T, w[:, 1::2].T], dim=0)  # [2I, D]
        down = self.reader.get_row(dn, k).T  # [D, I]
        if biases is None:
            return ExpertTensors(gate_up, down)
        b = self.reader.get_row(biases[0], k)
        return ExpertTensors(gate_up, down, torch.cat([b[0::2], b[1::2]]), self.reader.get_row(biases[1], k))

    def load(self, expert: int) -> ExpertTensors:
        return self._load(expert)
