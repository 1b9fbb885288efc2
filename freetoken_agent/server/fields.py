"""Typed reading of JSON request bodies: every field is checked for type and range, and every field a body carries
is either read, accepted as having no effect on a local server, or refused with a message that names it.

The three APIs (OpenAI chat/completions, Anthropic Messages, OpenAI Responses) read their bodies through
:class:`Fields`, so a malformed body is always a :class:`RequestError` (HTTP 4xx with the field's name), never a
traceback.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

MAX_INT = 2**63 - 1
"""Largest integer any field takes (seeds are reduced modulo 2**64 by torch; larger ones are refused)."""


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP code (400 unless said), ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def type_name(value: Any) -> str:
    """A JSON type name for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


class Fields:
    """One JSON object being read: ``get_*`` take and check a field; :meth:`done` refuses the fields not taken.

    ``path`` prefixes field names in messages (``messages[2].content``). ``ignored`` are fields accepted without
    effect (bookkeeping such as ``user`` or ``metadata``, which a local server has no use for).
    """

    def __init__(self, value: Any, path: str = "", ignored: Iterable[str] = ()) -> None:
        if not isinstance(value, dict):
            raise RequestError(f"{path or 'the request body'} must be a JSON object, got {type_name(value)}",
                               path or None)
        self.body: dict[str, Any] = value
        self.path = path
        self._taken: set[str] = set(ignored)

    def name(self, key: str) -> str:
        """The field's full name for messages."""
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        """Whether the field is present and not null."""
        return self.body.get(key) is not None

    def raw(self, key: str) -> Any:
        """The field's value unchecked (the caller checks it); marks it read."""
        self._taken.add(key)
        return self.body.get(key)

    def _fail(self, key: str, want: str) -> RequestError:
        value = self.body.get(key)
        shown = repr(value) if isinstance(value, (int, float, bool)) or value is None else type_name(value)
        return RequestError(f"'{self.name(key)}' must be {want}, got {shown}", self.name(key))

    def str_(self, key: str, default: str | None = None, required: bool = False,
             choices: Iterable[str] | None = None) -> str | None:
        value = self.raw(key)
        if value is None:
            if required:
                raise RequestError(f"'{self.name(key)}' is required", self.name(key))
            return default
        if not isinstance(value, str):
            raise self._fail(key, "a string")
        allowed = tuple(choices or ())
        if allowed and value not in allowed:
            raise RequestError(f"'{self.name(key)}' must be one of {', '.join(allowed)}; got {value[:80]!r}",
                               self.name(key))
        return value

    def int_(self, key: str, default: int | None = None, low: int = -MAX_INT, high: int = MAX_INT,
             required: bool = False) -> int | None:
        value = self.raw(key)
        if value is None:
            if required:
                raise RequestError(f"'{self.name(key)}' is required", self.name(key))
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_INT:
            value = int(value)  # 16.0 is an integer in JSON
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._fail(key, f"an integer in [{low}, {high}]")
        return value

    def num(self, key: str, default: float | None = None, low: float = -math.inf, high: float = math.inf,
            ) -> float | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, f"a number in [{low}, {high}]")
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            raise self._fail(key, f"a number in [{low}, {high}]") from None
        if not math.isfinite(number) or not low <= number <= high:
            raise self._fail(key, f"a number in [{low}, {high}]")
        return number

    def bool_(self, key: str, default: bool = False) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def list_(self, key: str, required: bool = False, allow_empty: bool = True, limit: int = 100_000) -> list[Any]:
        value = self.raw(key)
        if value is None:
            if required:
                raise RequestError(f"'{self.name(key)}' is required", self.name(key))
            return []
        if not isinstance(value, list):
            raise self._fail(key, "an array")
        if not value and not allow_empty:
            raise RequestError(f"'{self.name(key)}' must not be empty", self.name(key))
        if len(value) > limit:
            raise RequestError(f"'{self.name(key)}' has {len(value)} entries; at most {limit}", self.name(key))
        return value

    def obj(self, key: str, ignored: Iterable[str] = ()) -> Fields | None:
        """A nested object as :class:`Fields` (None when absent)."""
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._fail(key, "an object")
        return Fields(value, self.name(key), ignored)

    def refuse_unless(self, key: str, ok: Any, why: str) -> None:
        """Accept the field only at a value that changes nothing (``ok``); else refuse it, saying ``why``."""
        value = self.raw(key)
        if value is not None and value != ok:
            raise RequestError(f"'{self.name(key)}' is not supported: {why}", self.name(key))

    def done(self) -> None:
        """Refuse the first field that was neither read nor accepted: nothing a client sends is silently dropped."""
        for key, value in self.body.items():
            if key not in self._taken and value is not None:  # null is the same as absent
                raise RequestError(f"unsupported field '{self.name(key)}'", self.name(key))


def stop_list(value: Any, name: str, limit: int = 16) -> tuple[str, ...]:
    """A stop field: a string or a list of strings (at most ``limit``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(f"'{name}' must be a string or an array of strings", name)
    if len(value) > limit:
        raise RequestError(f"'{name}' has {len(value)} entries; at most {limit}", name)
    return tuple(s for s in value if s)
