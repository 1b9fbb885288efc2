"""Rotary position embeddings: inverse frequencies for each scaling kind, and their application.

Legend: T tokens, H heads, R rotated channels (``RopeSpec.dim``), Dh head dim.
"""

from __future__ import annotations

import math

import torch

from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.spec import RopeSpec

SMALL_ROPE = 1 << 14  # values up to which a rotation runs in C (a decode step's q and k), where the kernels are loaded


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scaling(rope: RopeSpec) -> tuple[torch.Tensor, float]:
    """Returns ``(inv_freq [R/2], attention_scaling)``; cos/sin are multiplied by the scaling (YaRN mscale)."""
    dim, base = rope.dim, rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        old_len = rope.original_max_position or rope.max_position
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.kind == "yarn":
        return _yarn(rope)
    raise ValueError(f"unknown rope kind {rope.kind!r}")


def _yarn(rope: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.dim, rope.theta, rope.factor
    original = rope.original_max_position or rope.max_position
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = float(_mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim))
        else:
            attention = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation per channel pair
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class Rotary:
    """Precomputed cos/sin for one ``RopeSpec``; grows its table on demand."""

    def __init__(self, rope: RopeSpec, device: torch.device | str = "cpu") -> None:
        self.spec = rope
        self.inv_freq, self.scaling = inv_freq_and_scaling(rope)
        self.inv_freq = self.inv_freq.to(device)
        self._cos = self._sin = torch.empty(0, device=device)
        self._last: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] = (None, self._cos, self._sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, R/2] in fp32 for the given integer positions [T]."""
        if positions is self._last[0]:  # every layer of a forward asks for the same positions
            return self._last[1], self._last[2]
        needed = int(positions.max().item()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 256)
            t = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            freqs = t[:, None] * self.inv_freq[None, :]  # [S, R/2]
            self._cos, self._sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        cos, sin = self._cos[positions], self._sin[positions]
        self._last = (positions, cos, sin)  # holds the positions tensor: its identity cannot be reused meanwhile
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str | None = None) -> torch.Tensor:
        """Rotate the first R channels of ``x`` [T, H, Dh]; cos/sin [T, R/2] (``style`` overrides the spec's)."""
        r = self.spec.dim
        if (
            x.dim() == 3
            and x.numel() <= SMALL_ROPE
            and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.is_contiguous()
            and cos.is_contiguous()
            and sin.is_contiguous()
            and x.device.type == "cpu"
            and kops.fast() is not None
        ):  # a decode step: one C call instead of ~8 torch ops
            return kops.rope(x, cos, sin, r, (style or self.spec.style) == "half")
        rot, rest = x[..., :r].float(), x[..., r:]
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
        if (style or self.spec.style) == "half":
            a, b = rot[..., : r // 2], rot[..., r // 2 :]
            out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
        out = out.to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
