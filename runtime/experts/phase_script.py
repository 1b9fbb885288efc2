"""Onset scripts: what each of a phase's first tokens routes to, position by position, staged just ahead of use.

A phase starts the same way turn after turn: a plan turn with the framing ``<|im_end|>\\n<|im_start|>assistant\\n``
and ``THOUGHT:``, a tool call with ``<tool_call>\\n{"name": "bash", "arguments": {"command": "``. Their routing
repeats *by position*, which a profile of the whole onset blurs: the union of the onset's experts is wider than a
small slot pool holds, and staging it all at the hint either does not fit or evicts what the first tokens need.

So the scheduler also keeps one profile per position after a hint (``script_key``): ``phase#p`` for the prefill
that starts a turn (its chunks as one position: the framing, or the tool output it follows) and ``phase#0`` …
``phase#{SCRIPT_TOKENS-1}`` for the first generated tokens. At the hint it stages ``#p`` and the first ``AHEAD``
positions' experts (also during a tool pause, for the plan turn that follows); each time a token is routed it stages
the experts of the position ``AHEAD`` tokens later, reserved through the switch. Reads are ~1 ms and a token ~6 ms
on the built-in model, so staging one position ahead keeps the read queue short. Only positions that repeat get
staged (``MIN_SHARE``): the framing and the first words; later plan text is content, left to the phase profile.
"""

from __future__ import annotations

from freetoken_agent.runtime.experts.phase_profiles import Key, PhaseProfiles

SCRIPT_TOKENS = 16
"""Generated tokens after a hint that get a profile of their own (the switch window)."""
AHEAD = 1
"""Positions staged ahead of the token being computed (1 was best on training sessions: 4,034 switch misses vs
4,340 with 2 and 4,504 with 4, where staging further ahead evicts what the current tokens still use)."""
MIN_SHARE = 0.2
"""A key is staged for a position when it took at least this share of that position's top-k choices in its layer
(top-2 routing: an expert chosen every time has 0.5)."""


def script_key(phase: str, position: int | None) -> str:
    """The profile name of ``phase``'s generated token ``position`` after its hint (None: the turn's prefill)."""
    return f"{phase}#{'p' if position is None else position}"


def script_keys(profiles: PhaseProfiles, phase: str, position: int | None) -> list[Key]:
    """The keys ``phase``'s ``position`` usually routes to (share ≥ ``MIN_SHARE``), layer by layer."""
    rows = profiles.shares.get(script_key(phase, position), {})
    keys = [((layer, e), s) for layer, row in rows.items() for e, s in enumerate(row) if s >= MIN_SHARE]
    keys.sort(key=lambda ks: (ks[0][0], -ks[1]))
    return [k for k, _ in keys]
