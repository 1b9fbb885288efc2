"""Numbers a model can send to every numeric tool argument: NaN, infinities, negatives and huge values are refused
by schema validation before the tool runs (``min(nan, cap)`` is NaN: a NaN timeout used to mean no timeout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, tool

pytestmark = pytest.mark.anyio

NUMERIC = [  # (tool, the other arguments, the numeric field)
    ("run_shell", {"command": "touch ran"}, "timeout_s"),
    ("run_tests", {"paths": ["ran"]}, "timeout_s"),
    ("read_file", {"path": "f.txt"}, "start_line"),
    ("read_file", {"path": "f.txt"}, "end_line"),
    ("list_files", {}, "max_entries"),
    ("glob", {"pattern": "*"}, "max_results"),
    ("search", {"pattern": "x"}, "max_results"),
]
BAD = ["NaN", "Infinity", "-Infinity", "-1", "1e400", "100000000000000000000000000000", "0"]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name,args,field", NUMERIC)
async def test_bad_numbers_are_refused_before_the_tool_runs(
    root: Path, ctx: ToolContext, registry: ToolRegistry, name: str, args: dict[str, object], field: str, value: str
) -> None:
    (root / "f.txt").write_text("x\n")
    raw = json.dumps(args)[:-1] + ("," if args else "") + f'"{field}": {value}' + "}"  # JSON text as a model sends it
    result = await registry.call(name, raw, ctx)
    assert result.is_error and result.content.startswith(f"Invalid arguments for tool '{name}': field '{field}'")
    assert not (root / "ran").exists()


async def test_non_finite_numbers_are_refused_for_user_tools_too(ctx: ToolContext) -> None:
    calls: list[float] = []

    @tool
    def scale(factor: float, items: list[float]) -> str:
        """Scale.

        Args:
            factor: The factor.
            items: Numbers.
        """
        calls.append(factor)
        return "ok"

    result = await ToolRegistry([scale]).call("scale", '{"factor": 2, "items": [1, NaN]}', ctx)
    assert result.is_error and "field 'items.1': nan is not a finite number" in result.content and calls == []
    assert not (await ToolRegistry([scale]).call("scale", '{"factor": -2.5, "items": []}', ctx)).is_error


def test_context_clamp_treats_nan_as_unset(ctx: ToolContext) -> None:
    assert ctx.clamp_timeout(float("nan")) == ctx.timeout_s
    assert ctx.clamp_timeout(float("inf")) == ctx.timeout_s
    assert ctx.clamp_timeout(1e9) == ctx.max_timeout_s
