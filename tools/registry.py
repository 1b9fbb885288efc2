"""``ToolRegistry``: the tools a model may call, by name; runs its calls.

Every failure a model can cause (unknown tool, arguments that are not JSON, arguments that break the schema, a tool
that raises) comes back from :meth:`ToolRegistry.call` as a :class:`ToolResult` with ``is_error=True`` and a message
written for the model; ``call`` itself never raises for them.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from freetoken_agent.tools.context import ToolContext, ToolResult
from freetoken_agent.tools.definition import Tool, ToolKind, tool

__all__ = ["Tool", "ToolKind", "ToolRegistry", "tool"]

DURATION_EMA = 0.3  # weight of the newest measured duration in ToolRegistry.expected_s


class ToolRegistry:
    """An ordered set of tools by name: hands their schemas to the model and runs its calls."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._observed_s: dict[str, float] = {}  # EMA of measured call durations, by tool name
        for item in tools:
            self.add(item)

    @classmethod
    def from_object(cls, obj: Any, names: Iterable[str] | None = None) -> ToolRegistry:
        """Tools from an object's methods: those decorated with ``@tool``, plus the methods listed in ``names``."""
        registry = cls()
        seen: dict[str, Tool] = {}
        for klass in reversed(type(obj).__mro__):  # definition order, subclasses override
            for attr, member in vars(klass).items():
                if isinstance(member, Tool):
                    seen.pop(attr, None)
                    seen[attr] = member
                elif attr in seen:
                    del seen[attr]  # a subclass replaced the tool with a plain attribute
        for member in seen.values():
            registry.add(member.bind(obj))
        for attr in names or ():
            method = getattr(obj, attr, None)
            if method is None or not callable(method):
                raise TypeError(f"{type(obj).__name__} has no method {attr!r}")
            registry.add(method)
        if not registry._tools:
            raise TypeError(f"{type(obj).__name__} has no @tool methods and no method names were given")
        return registry

    def add(self, item: Tool | Callable[..., Any], *, replace: bool = False) -> Tool:
        """Register a :class:`Tool` or a plain typed function (wrapped with default options)."""
        new = item if isinstance(item, Tool) else Tool(item)
        if new.name in self._tools and not replace:
            raise ValueError(f"a tool named {new.name!r} is already registered")
        self._tools[new.name] = new
        return new

    def remove(self, name: str) -> None:
        """Unregister a tool by name (``KeyError`` if absent)."""
        del self._tools[name]

    def get(self, name: str) -> Tool:
        """The tool called ``name``; ``KeyError`` naming the available tools if absent."""
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; available: {', '.join(self._tools) or '(none)'}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        """Tool names in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function-tool definitions for every tool, in registration order."""
        return [item.schema() for item in self._tools.values()]

    async def call(self, name: str, arguments: dict[str, Any] | str | None, ctx: ToolContext | None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a dict or a JSON string). Model-caused failures never raise."""
        found = self._tools.get(name)
        if found is None:
            available = ", ".join(self._tools) or "(none)"
            close = difflib.get_close_matches(name, list(self._tools), n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            return ToolResult.error(f"Unknown tool '{name}'.{hint} Available tools: {available}.")
        started = time.monotonic()
        result = await found.invoke(arguments, ctx)
        elapsed = time.monotonic() - started
        previous = self._observed_s.get(name)
        self._observed_s[name] = elapsed if previous is None else previous + DURATION_EMA * (elapsed - previous)
        return result

    def expected_s(self, name: str) -> float | None:
        """How long a call to ``name`` is expected to take: the running average of measured calls when there are
        any (an EMA, so it follows the project at hand), else the tool's declared ``expected_s``, else None."""
        observed = self._observed_s.get(name)
        if observed is not None:
            return observed
        found = self._tools.get(name)
        return found.expected_s if found is not None else None
