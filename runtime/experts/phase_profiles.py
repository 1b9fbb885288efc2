"""Per-phase routing profiles: which experts each agent phase (plan, code, tool) routes to, per layer.

A profile is, per ``(phase, layer)``, a distribution over the layer's experts: the share of that phase's top-k
choices that went to each expert. Routing counts accumulate over a *turn* (one phase segment, closed by the next
phase hint) and are folded into the profile as an EMA over turns (``alpha`` per turn), so recent sessions weigh
more but one odd turn does not erase the history.

A session starts from the model's profile (loaded from ``$FREETOKEN_CACHE/profiles/<model-key>.json``, default
``~/.cache/freetoken/profiles``), updates its own copy turn by turn, and ``save`` writes it back for the next
session. Shares are per layer (each layer sums to 1), so they compare across layers: the global hot set of a
phase is simply the keys with the highest shares.

Legend: L layers, E experts, K experts per token.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from freetoken_agent.runtime.errors import FreeTokenError

Key = tuple[int, int]
"""(layer, expert)."""
VERSION = 1


def profiles_root() -> Path:
    """``$FREETOKEN_CACHE/profiles`` (default ``~/.cache/freetoken/profiles``)."""
    return Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "profiles"


def model_key(model_dir: Path) -> str:
    """Identifies a model's profile: its config and the names and sizes of its weight files (not their mtimes:
    a copied checkpoint keeps its profile)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(f"profile-v{VERSION}".encode())
    config = model_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:20]


def profile_path(model_dir: Path) -> Path:
    """Where the profile of the model in ``model_dir`` is kept."""
    return profiles_root() / f"{model_key(model_dir)}.json"


class PhaseProfiles:
    """EMA over turns of routing shares per (phase, layer, expert); see the module docstring."""

    def __init__(self, layers: Iterable[int], experts: int, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise FreeTokenError(f"profile alpha must be in (0, 1], got {alpha}")
        self.layers = sorted(layers)
        self.experts = experts
        self.alpha = alpha
        self.shares: dict[str, dict[int, list[float]]] = {}
        """phase → layer → [E] share of the phase's choices (sums to 1 per layer once seen)."""
        self.turns: dict[str, int] = {}
        """Turns folded in per phase."""
        self._turn: dict[str, dict[int, list[float]]] = {}

    # ---------------------------------------------------------------- recording

    def observe(self, phase: str, layer: int, counts: dict[int, int] | list[int]) -> None:
        """Tokens routed to each expert of ``layer`` during ``phase`` (accumulated into the open turn)."""
        acc = self._turn.setdefault(phase, {}).setdefault(layer, [0.0] * self.experts)
        items = counts.items() if isinstance(counts, dict) else enumerate(counts)
        for e, n in items:
            acc[e] += n

    def end_turn(self) -> list[str]:
        """Fold the open turn's counts into the EMA; returns the phases updated."""
        done = []
        for phase, layers in self._turn.items():
            target = self.shares.setdefault(phase, {})
            first = self.turns.get(phase, 0) == 0
            for layer, acc in layers.items():
                total = sum(acc)
                if total <= 0:
                    continue
                dist = [c / total for c in acc]
                old = target.get(layer)
                if old is None or first:
                    target[layer] = dist
                else:
                    target[layer] = [(1 - self.alpha) * o + self.alpha * d for o, d in zip(old, dist)]
            self.turns[phase] = self.turns.get(phase, 0) + 1
            done.append(phase)
        self._turn = {}
        return done

    # ---------------------------------------------------------------- queries

    def share(self, phase: str, key: Key) -> float:
        """The share of ``phase``'s choices in ``key``'s layer that went to ``key`` (0 when never seen)."""
        row = self.shares.get(phase, {}).get(key[0])
        return row[key[1]] if row is not None else 0.0

    def known(self, phase: str) -> bool:
        return bool(self.shares.get(phase))

    def hot_set(self, phase: str, n: int, min_share: float = 0.0) -> list[Key]:
        """The ``n`` keys with the highest share in ``phase`` (hottest first), those above ``min_share`` only."""
        keys = [((layer, e), s) for layer, row in self.shares.get(phase, {}).items() for e, s in enumerate(row)
                if s > min_share]
        keys.sort(key=lambda ks: (-ks[1], ks[0]))
        return [k for k, _ in keys[: max(n, 0)]]

    # ---------------------------------------------------------------- persistence

    def copy(self) -> PhaseProfiles:
        other = PhaseProfiles(self.layers, self.experts, self.alpha)
        other.shares = {p: {layer: list(row) for layer, row in rows.items()} for p, rows in self.shares.items()}
        other.turns = dict(self.turns)
        return other

    def to_json(self) -> dict[str, object]:
        return {"version": VERSION, "layers": self.layers, "experts": self.experts, "alpha": self.alpha,
                "turns": self.turns,
                "shares": {p: {str(layer): list(row) for layer, row in rows.items()}
                           for p, rows in self.shares.items()}}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> PhaseProfiles:
        try:
            if data["version"] != VERSION:
                raise ValueError(f"version {data['version']}")
            prof = cls(data["layers"], int(data["experts"]), float(data["alpha"]))  # type: ignore[arg-type]
            prof.turns = {str(p): int(n) for p, n in data["turns"].items()}  # type: ignore[union-attr]
            prof.shares = {str(p): {int(layer): [float(v) for v in row] for layer, row in rows.items()}
                           for p, rows in data["shares"].items()}  # type: ignore[union-attr]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FreeTokenError(f"not a phase profile: {exc}") from None
        for rows in prof.shares.values():
            for layer, row in rows.items():
                if len(row) != prof.experts or layer not in prof.layers:
                    raise FreeTokenError(f"phase profile row for layer {layer} does not match {prof.experts} experts")
        return prof

    def save(self, path: Path) -> None:
        """Write atomically (a temporary file renamed over ``path``): a crash never leaves half a profile."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json()) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, layers: Iterable[int], experts: int, alpha: float = 0.3) -> PhaseProfiles:
        """The profile at ``path`` if it exists and fits this model's shape, else an empty one (a cold start)."""
        path = Path(path)
        layers = sorted(layers)
        if path.is_file():
            try:
                prof = cls.from_json(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, json.JSONDecodeError, FreeTokenError):
                prof = None  # unreadable or another shape: start cold, the next save replaces it
            if prof is not None and prof.layers == layers and prof.experts == experts:
                prof.alpha = alpha
                return prof
        return cls(layers, experts, alpha)
