"""Declarative value rules: what a config field, a sampling parameter or a CLI flag may hold.

One ``Rule`` says the type (integer, number, boolean, string, object, list), the range, whether ``null`` and
non-finite numbers are allowed, and whether a per-layer list of such values is accepted. Config validation
(``runtime/model/validate.py``), ``SamplingParams`` and the CLI's flag parsers all read the same rules, so a value is
judged the same way whichever door it comes in by, and every refusal names the field and says what was expected.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["int", "number", "bool", "str", "dict", "list"]
_NOUNS = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
          "dict": "an object", "list": "a list"}


@dataclass(frozen=True)
class Rule:
    """What one value may be. Bounds apply to ``int`` and ``number`` kinds (and to every item of a list)."""

    kind: Kind
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """True: the value must be strictly greater than ``low``."""
    high_open: bool = False
    finite: bool = True
    """``number`` values must be finite (NaN and infinities refused)."""
    nullable: bool = False
    per_layer: bool = False
    """A non-empty list of such values (one per layer, several end tokens) is accepted too."""
    items: Rule | None = None
    """``list`` kind: the rule every item follows."""

    def describe(self) -> str:
        """The expected value in words, e.g. ``an integer ≥ 1`` or ``a finite number in (0, 1]``."""
        text = self._core()
        if self.per_layer:
            text += " (or a list of them)"
        return text + (" or null" if self.nullable else "")

    def _core(self) -> str:
        noun = "a finite number" if self.kind == "number" and self.finite else _NOUNS[self.kind]
        if self.kind == "list" and self.items is not None:
            noun = f"a list of items each {self.items.describe()}"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            noun += f" in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            noun += f" {'>' if self.low_open else '≥'} {_num(self.low)}"
        elif self.high is not None:
            noun += f" {'<' if self.high_open else '≤'} {_num(self.high)}"
        return noun

    def problem(self, value: Any) -> str | None:
        """None when ``value`` follows the rule, else what is wrong (``must be an integer ≥ 1, got 256.5``)."""
        if value is None:
            return None if self.nullable else f"must be {self.describe()}, got null"
        if self.per_layer and isinstance(value, list):
            if not value:
                return f"must be {self.describe()}, got an empty list"
            for i, item in enumerate(value):
                if (msg := self._one(item, self._core())) is not None:
                    return f"item {i} {msg}"
            return None
        return self._one(value, self.describe())

    def parse(self, text: str) -> Any:
        """A command-line string as this rule's value; ``ValueError`` with the problem when it is not one."""
        if self.nullable and text.lower() in ("none", "null"):
            return None
        value: Any = text
        try:
            if self.kind == "int":
                value = int(text)
            elif self.kind == "number":
                value = float(text)
        except ValueError:
            raise ValueError(f"must be {self.describe()}, got {text!r}") from None
        if (msg := self.problem(value)) is not None:
            raise ValueError(msg)
        return value

    def _one(self, value: Any, expected: str) -> str | None:
        bad = f"must be {expected}, got {_show(value)}"
        if self.kind == "int" and not (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
            return bad
        if self.kind == "number":
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                return bad
            try:
                if self.finite and not math.isfinite(float(value)):
                    return bad
            except OverflowError:  # an integer too large for a float
                return bad
            if math.isnan(float(value)):
                return bad
        if self.kind == "bool" and not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
            return bad
        if self.kind == "str" and not isinstance(value, str):
            return bad
        if self.kind == "dict" and not isinstance(value, dict):
            return bad
        if self.kind == "list":
            if not isinstance(value, list):
                return bad
            if self.items is not None:
                for i, item in enumerate(value):
                    if (msg := self.items.problem(item)) is not None:
                        return f"item {i} {msg}"
        if self.kind in ("int", "number") and not self._in_range(value):
            return bad
        return None

    def _in_range(self, value: Any) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


def Int(low: float | None = None, high: float | None = None, **kw: Any) -> Rule:
    """An integer rule (``bool`` is not an integer here)."""
    return Rule("int", low, high, **kw)


def Num(low: float | None = None, high: float | None = None, **kw: Any) -> Rule:
    """A finite real-number rule (integers accepted)."""
    return Rule("number", low, high, **kw)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else repr(x)


def _show(value: Any) -> str:
    """A value as it appears in a message: JSON-like and short."""
    text = {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
