"""Teacher forcing through the engine's scheduler: feed a recorded token stream, as a session would prefill it.

Benchmarks that replay a fixed stream (expert residency, phase staging) feed it through ``Session.prefill`` — the
scheduler, the one path that runs the model — instead of calling the decoder. When the KV pool (which shares the
memory budget with the expert pool) cannot hold the whole stream, the context restarts from the tokens being fed:
these benchmarks measure expert traffic, which depends on the tokens, not on how far back attention reaches.
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.kv.pool import OutOfPages


class Feeder:
    """Feeds tokens into one engine session, restarting the context when the KV pool is full."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.session = engine.session()
        self.context: list[int] = []
        self.restarts = 0

    def feed(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the context and compute their KV (one scheduler request)."""
        self.context += [int(t) for t in tokens]
        try:
            self.session.prefill(self.context)
        except OutOfPages:
            self.session.close()
            self.session = self.engine.session()
            self.context = [int(t) for t in tokens]
            self.restarts += 1
            self.session.prefill(self.context)

    def close(self) -> None:
        self.session.close()
