"""Typed parsers for numeric flags: a bad value is one line naming the flag, before any model loads.

Each parser is a ``runtime.rules.Rule`` read from its home (sampling flags from ``SAMPLING_RULES``, so the CLI and
``SamplingParams`` judge a value the same way); argparse reports a refusal as
``freetoken generate: error: argument --temperature: must be a finite number ≥ 0, got nan``. Importing this module
stays cheap: the sampling rules (which live beside torch code) are looked up only when such a flag is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from freetoken_agent.runtime.rules import Int, Num, Rule


def _parser(rule: Callable[[], Rule], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return rule().parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def count(low: int = 1) -> Callable[[str], int]:
    """An integer ≥ ``low`` (threads, steps, tokens, workers)."""
    rule = Int(low)
    return _parser(lambda: rule, "count")


def seconds() -> Callable[[str], float]:
    """A finite number of seconds > 0."""
    rule = Num(0, low_open=True)
    return _parser(lambda: rule, "seconds")


def port() -> Callable[[str], int]:
    """A TCP port (0: any free one)."""
    rule = Int(0, 65535)
    return _parser(lambda: rule, "port")


def sampling(field: str) -> Callable[[str], Any]:
    """The value of ``SamplingParams.<field>`` (temperature, top_p, top_k, max_new_tokens, seed)."""

    def rule() -> Rule:
        from freetoken_agent.runtime.generation.sampling import SAMPLING_RULES

        return SAMPLING_RULES[field]

    return _parser(rule, field)
