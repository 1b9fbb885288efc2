"""Model layout: the typed ``ModelSpec`` (one normalization point for every architecture) and the generic decoder."""

from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RopeSpec,
    RouterSpec,
)

__all__ = ["AttentionSpec", "LayerSpec", "MLPSpec", "ModelSpec", "MoESpec", "RopeSpec", "RouterSpec"]
