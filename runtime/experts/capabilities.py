"""What an experts backend can do, as data: callers read ``backend.capabilities`` instead of probing classes.

Every backend the quantized-expert core builds (``runtime/experts/core.py``) carries a ``Capabilities``; the plain
torch reference (``model.moe.TorchExperts``, the float experts a checkpoint loads as) has none and reads as
``REFERENCE`` through ``capabilities_of``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEMENTS = ("resident", "mapped", "managed")
"""Where a backend's experts live: ``resident`` (all in memory), ``mapped`` (quantized, read from the expert cache
file), ``managed`` (budgeted tiers of slots filled from the expert cache file, ``runtime/experts/store.py``)."""


@dataclass(frozen=True)
class Capabilities:
    """What one MoE layer's experts backend is and supports."""

    placement: str
    """One of ``PLACEMENTS``."""
    formats: tuple[str, ...]
    """Storage formats of its experts: block formats (``q4_0``) or float dtypes (``float32``); empty: as loaded."""
    kernels: bool
    """The C kernels compute it (quantized weights in their tile layout)."""
    modes: bool
    """``set_expert_mode`` switches how it computes (``auto`` / ``exact`` / ``int8``)."""
    dequantize: bool
    """It can give back the fp32 experts its bytes stand for (``dequantize()``: references and checks)."""
    fused: bool
    """Decode runs as one fused C call per layer step over all of its experts."""
    can_prefetch: bool
    """It reads the next layer's predicted experts ahead of time (gate look-ahead)."""

    @property
    def quantized(self) -> bool:
        """Whether its experts are stored in a block format."""
        return any(f.startswith("q") for f in self.formats)


REFERENCE = Capabilities("resident", (), kernels=False, modes=False, dequantize=False, fused=False,
                         can_prefetch=False)
"""The plain-torch experts of a loaded checkpoint (no ``capabilities`` attribute of their own)."""


def capabilities_of(backend: Any) -> Capabilities:
    """``backend.capabilities``, or ``REFERENCE`` for the plain-torch experts, which carry none."""
    caps = getattr(backend, "capabilities", None)
    return caps if isinstance(caps, Capabilities) else REFERENCE
