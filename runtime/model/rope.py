"""Rotary position embeddings: inverse frequencies for each scaling kind, and their application.

Legend: T tokens, H heads, R rotated channels (``RopeSpec.dim``), Dh head dim.
"""

from __future__ import annotations

import math

import torch

from freetoken_agent.runtime.errors import ConfigError
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.spec import RopeSpec

SMALL_ROPE = 1 << 14  # values up to which a rotation runs in C (a decode step's q and k), where the kernels are loaded

LENGTH_DEPENDENT = ("dynamic", "longrope")
"""Kinds whose frequencies follow the length of the forward that uses them (transformers' ``dynamic_rope_update``)."""


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim  # [R/2]


def inv_freq_and_scaling(rope: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Returns ``(inv_freq [R/2], attention_scaling)``; cos/sin are multiplied by the scaling.

    ``seq_len`` is the length of the forward (largest position + 1) for the length-dependent kinds (``dynamic``,
    ``longrope``); None gives the frequencies transformers builds at init (the original context's).
    """
    dim, base = rope.dim, rope.theta
    if rope.kind in ("default", "linear"):
        return 1.0 / (base ** _exponents(dim)) / (rope.factor if rope.kind == "linear" else 1.0), 1.0
    if rope.kind == "ntk_alpha":  # Hunyuan: a fixed NTK stretch of the base
        return 1.0 / ((base * float(rope.alpha or 1.0) ** (dim / (dim - 2))) ** _exponents(dim)), 1.0
    if rope.kind == "dynamic":
        return _dynamic(rope, seq_len), 1.0
    if rope.kind == "llama3":
        return _llama3(rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope)
    if rope.kind == "longrope":
        return _longrope(rope, seq_len)
    if rope.kind == "proportional":
        angles = int(rope.proportion * dim // 2)
        turning = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float32) / dim))
        inv_freq = torch.cat((turning, torch.zeros(dim // 2 - angles, dtype=torch.float32)))
        return inv_freq / rope.factor, 1.0
    raise ConfigError(f"unknown rope type {rope.kind!r}")


def _dynamic(rope: RopeSpec, seq_len: int | None) -> torch.Tensor:
    """NTK scaling by the forward's length: the base grows once the length passes ``max_position``.

    Computed as transformers does, in fp32 tensor arithmetic (its ``seq_len`` is a tensor at run time), so the
    frequencies are bit-identical."""
    dim, max_pos = rope.dim, rope.max_position
    if seq_len is None or seq_len <= max_pos:
        return 1.0 / (rope.theta ** _exponents(dim))
    seq = torch.tensor(seq_len, dtype=torch.int64)
    base = rope.theta * ((rope.factor * seq / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))  # fp32 scalar
    return 1.0 / (base ** _exponents(dim))


def _llama3(rope: RopeSpec) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** _exponents(rope.dim))
    old_len = rope.original_max_position or rope.max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(rope: RopeSpec, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE: per-frequency divisors, the short set within the original context and the long set beyond it."""
    original = rope.original_max_position or rope.max_position
    attention = rope.attention_factor
    if attention is None:
        factor = rope.factor  # the adapter sets max_position / original when the config gives none
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    factors = rope.long_factor if long else rope.short_factor
    if factors is None or len(factors) != rope.dim // 2:
        raise ConfigError(f"longrope needs short_factor and long_factor with {rope.dim // 2} values each "
                          f"(rotary dim {rope.dim} / 2), got {None if factors is None else len(factors)}")
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * rope.theta ** _exponents(rope.dim)), float(attention)


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
    """Precomputed cos/sin for one ``RopeSpec``; grows its table on demand.

    For the length-dependent kinds (``dynamic``, ``longrope``) the frequencies of a forward follow its length, as
    transformers' ``dynamic_rope_update`` does: each sequence of a step is rotated with the frequencies for its
    largest position + 1 in that step (a prefill with its whole chunk, a decode step with the positions so far).
    transformers keeps the largest length it has seen across calls; a fresh sequence whose positions only grow
    (every prefill-then-decode) gets the same frequencies from both.
    """

    def __init__(self, rope: RopeSpec, device: torch.device | str = "cpu") -> None:
        self.spec = rope
        self.inv_freq, self.scaling = inv_freq_and_scaling(rope)
        self.inv_freq = self.inv_freq.to(device)
        self.length_dependent = rope.kind in LENGTH_DEPENDENT and rope.frequency_update or rope.long_mscale is not None
        self._cos = self._sin = torch.empty(0, device=device)
        self._last: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] = (None, self._cos, self._sin)
        self._long: tuple[torch.Tensor, float] | None = None
        self._primed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, R/2] in fp32 for the given integer positions [T].

        ``lengths``: the row counts of the sequences whose rows ``positions`` holds, in order (None: one sequence);
        only the length-dependent kinds use it."""
        if positions is self._last[0]:  # every layer of a forward asks for the same positions
            return self._last[1], self._last[2]
        if (primed := self._primed.get(id(positions))) is not None and primed[0] is positions:
            return primed[1], primed[2]
        if self.length_dependent and positions.numel():
            parts = positions.split(lengths) if lengths is not None else (positions,)
            tables = [self._for_length(part) for part in parts]
            cos, sin = (torch.cat([t[k] for t in tables]) if len(tables) > 1 else tables[0][k] for k in (0, 1))
        else:
            cos, sin = self._table(positions)
        self._last = (positions, cos, sin)  # holds the positions tensor: its identity cannot be reused meanwhile
        return cos, sin

    def prime(self, positions: list[torch.Tensor], lengths: list[int], batch: torch.Tensor | None = None) -> None:
        """Fix the length-dependent frequencies of one forward: each sequence's ``positions[b]`` turn as in a forward
        of ``lengths[b]`` tokens (its whole known length: a prefill split into chunks turns every chunk as one
        prefill of the prompt would); ``batch`` (all of them concatenated) gets the same rows. Later ``cos_sin``
        calls with these very tensors return them."""
        self._primed = {}
        if not self.length_dependent:
            return
        tables = [self._for_length(pos, length) for pos, length in zip(positions, lengths) if pos.numel()]
        for pos, (cos, sin) in zip([p for p in positions if p.numel()], tables):
            self._primed[id(pos)] = (pos, cos, sin)
        if batch is not None and tables:
            self._primed[id(batch)] = (batch, torch.cat([t[0] for t in tables]), torch.cat([t[1] for t in tables]))

    def _table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max().item()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 256)
            t = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            freqs = t[:, None] * self.inv_freq[None, :]  # [S, R/2]
            self._cos, self._sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return self._cos[positions], self._sin[positions]

    def _for_length(self, positions: torch.Tensor, length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] of one sequence's rows, with the frequencies of a forward of its length (at least
        ``length``)."""
        rope = self.spec
        seq_len = max(int(positions.max().item()) + 1, length)
        original = rope.original_max_position or rope.max_position
        scaling = self.scaling
        if rope.long_mscale is not None:  # PhiMoE: the scale follows the length, the frequencies may not
            scaling = rope.long_mscale if seq_len > original else float(rope.short_mscale or 1.0)
        if not (rope.frequency_update and rope.kind in LENGTH_DEPENDENT):
            inv_freq = self.inv_freq
        elif rope.kind == "longrope":
            if seq_len <= original:
                inv_freq = self.inv_freq
            else:
                if self._long is None:
                    inv, _ = inv_freq_and_scaling(rope, original + 1)
                    self._long = (inv.to(self.inv_freq.device), 0.0)
                inv_freq = self._long[0]
        elif seq_len <= rope.max_position:  # dynamic within the original context: the init frequencies
            inv_freq = self.inv_freq
        else:
            inv_freq = inv_freq_and_scaling(rope, seq_len)[0].to(self.inv_freq.device)
        if inv_freq is self.inv_freq and scaling == self.scaling:
            return self._table(positions)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
        return freqs.cos() * scaling, freqs.sin() * scaling

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str | None = None) -> torch.Tensor:
        """Rotate the first R channels of ``x`` [T, H, Dh]; cos/sin [T, R/2] (``style`` overrides the spec's)."""
        r = 2 * cos.shape[-1]  # an odd rotary dim has ceil(dim/2) frequencies; transformers turns 2·ceil(dim/2) channels
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
