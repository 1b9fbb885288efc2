"""ToolRegistry.call: every model-caused failure becomes an error ToolResult with a message the model can use."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pydantic
import pytest
from freetoken_agent.tools import (
    Tool,
    ToolContext,
    ToolError,
    ToolRegistry,
    ToolResult,
    Workspace,
    coding_tools,
    tool,
)

pytestmark = pytest.mark.anyio


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


@tool
async def slow_echo(text: str, delay_s: float = 0.0) -> str:
    """Echo after a delay."""
    await anyio.sleep(delay_s)
    return text


@tool
def where_am_i(ctx: ToolContext) -> str:
    """Report the workspace root and the thread."""
    return f"{ctx.workspace.root}|{threading.get_ident()}"


@tool
def explode(kind: str) -> str:
    """Fail on purpose."""
    if kind == "tool":
        raise ToolError("the widget is not ready")
    raise ValueError("boom")


class Limited(pydantic.BaseModel):
    count: int = pydantic.Field(ge=1, le=3)


@tool
def limited(item: Limited) -> str:
    """Take a constrained model."""
    return str(item.count)


async def test_valid_calls_dict_and_json(ctx: ToolContext) -> None:
    registry = ToolRegistry([add, slow_echo])
    assert (await registry.call("add", {"a": 3}, ctx)) == ToolResult(content="5")
    assert (await registry.call("add", '{"a": 3, "b": 4}', ctx)).content == "7"
    assert (await registry.call("add", '"{\\"a\\": 1}"', ctx)).content == "3"  # JSON object encoded twice
    assert (await registry.call("slow_echo", '{"text": "hi", "delay_s": 0.01}', ctx)).content == "hi"


async def test_unknown_tool_lists_available(ctx: ToolContext) -> None:
    result = await ToolRegistry([add, slow_echo]).call("subtract", {"a": 1}, ctx)
    assert result.is_error
    assert result.content == "Unknown tool 'subtract'. Available tools: add, slow_echo."


async def test_invalid_json_names_tool_and_expected_params(ctx: ToolContext) -> None:
    result = await ToolRegistry([add]).call("add", '{"a": 1,', ctx)
    assert result.is_error
    assert "Invalid arguments for tool 'add': not valid JSON" in result.content
    assert "Expected: a (integer, required), b (integer)." in result.content
    not_object = await ToolRegistry([add]).call("add", "[1, 2]", ctx)
    assert not_object.is_error and "expected a JSON object, got list" in not_object.content


async def test_schema_violations_name_each_field(ctx: ToolContext) -> None:
    registry = ToolRegistry([add])
    wrong_type = await registry.call("add", {"a": "three"}, ctx)
    assert wrong_type.is_error and "field 'a': 'three' is not of type 'integer'" in wrong_type.content
    missing = await registry.call("add", {"b": 1}, ctx)
    assert missing.is_error and "missing required field 'a'" in missing.content
    extra = await registry.call("add", {"a": 1, "c": 5}, ctx)
    assert extra.is_error and "unexpected field(s) 'c' (allowed: a, b)" in extra.content


async def test_nested_and_pydantic_only_constraints(ctx: ToolContext) -> None:
    registry = ToolRegistry([limited])
    assert (await registry.call("limited", {"item": {"count": 2}}, ctx)).content == "2"
    too_big = await registry.call("limited", {"item": {"count": 9}}, ctx)
    assert too_big.is_error and "field 'item.count'" in too_big.content and "3" in too_big.content


async def test_tool_exceptions_become_messages(ctx: ToolContext) -> None:
    registry = ToolRegistry([explode])
    expected = await registry.call("explode", {"kind": "tool"}, ctx)
    assert expected == ToolResult(content="Error from tool 'explode': the widget is not ready", is_error=True)
    bug = await registry.call("explode", {"kind": "bug"}, ctx)
    assert bug.is_error and bug.content.startswith("Tool 'explode' failed with ValueError: boom (at test_registry.py:")


async def test_context_injected_and_sync_tools_run_in_worker_thread(ctx: ToolContext) -> None:
    result = await ToolRegistry([where_am_i]).call("where_am_i", "", ctx)
    root, thread = result.content.split("|")
    assert Path(root) == ctx.workspace.root
    assert int(thread) != threading.get_ident()
    missing = await ToolRegistry([where_am_i]).call("where_am_i", {}, None)
    assert missing.is_error and "needs a ToolContext" in missing.content


async def test_async_tools_run_concurrently(ctx: ToolContext) -> None:
    registry = ToolRegistry([slow_echo])
    results: list[str] = []

    async def one(text: str) -> None:
        results.append((await registry.call("slow_echo", {"text": text, "delay_s": 0.3}, ctx)).content)

    start = anyio.current_time()
    async with anyio.create_task_group() as group:
        for text in "abcde":
            group.start_soon(one, text)
    assert sorted(results) == list("abcde")
    assert anyio.current_time() - start < 1.0  # five 0.3 s calls overlapped


async def test_return_values_are_rendered() -> None:
    @tool
    def as_dict() -> dict[str, int]:
        """A dict."""
        return {"n": 1}

    @tool
    def nothing() -> None:
        """Nothing."""

    registry = ToolRegistry([as_dict, nothing])
    assert await registry.call("as_dict", {}, None) == ToolResult(content='{"n": 1}', data={"n": 1})
    assert (await registry.call("nothing", None, None)).content == "(no output)"


def test_registry_management_and_schemas() -> None:
    def multiply(a: int, b: int) -> int:
        """Multiply."""
        return a * b

    registry = ToolRegistry([add])
    added = registry.add(multiply)  # plain functions are wrapped
    assert isinstance(added, Tool) and registry.names == ["add", "multiply"]
    assert [s["function"]["name"] for s in registry.schemas()] == ["add", "multiply"]
    assert registry.get("add") is add and "multiply" in registry and len(registry) == 2
    with pytest.raises(ValueError, match="already registered"):
        registry.add(add)
    with pytest.raises(KeyError, match="available: add, multiply"):
        registry.get("nope")
    registry.remove("multiply")
    assert registry.names == ["add"]


class Counter:
    """A stateful object whose methods are tools."""

    def __init__(self) -> None:
        self.value = 0

    @tool(writes=True)
    def bump(self, by: int = 1) -> int:
        """Increase the counter.

        Args:
            by: Step.
        """
        self.value += by
        return self.value

    def peek(self) -> int:
        """Current value."""
        return self.value


async def test_registry_from_object_binds_methods(ctx: ToolContext) -> None:
    counter = Counter()
    registry = ToolRegistry.from_object(counter, names=["peek"])
    assert registry.names == ["bump", "peek"]
    assert "self" not in registry.get("bump").parameters["properties"]
    assert registry.get("bump").writes
    assert (await registry.call("bump", {"by": 5}, ctx)).content == "5"
    assert (await registry.call("peek", {}, ctx)).content == "5"
    assert counter.bump(1) == 6  # the decorated method still works as a method
    with pytest.raises(TypeError, match="no @tool methods"):
        ToolRegistry.from_object(object())


async def test_cancel_scope_stops_a_sync_tool_wait(tmp_path: Path) -> None:
    started = threading.Event()

    @tool
    def blocking(ctx: ToolContext) -> str:
        """Wait until cancelled."""
        started.set()
        ctx.cancel_event.wait(10)
        return "stopped"

    context = ToolContext(Workspace(tmp_path))
    start = anyio.current_time()
    with anyio.move_on_after(0.3):
        await ToolRegistry([blocking]).call("blocking", {}, context)
    context.cancel()  # lets the abandoned worker thread finish
    assert started.is_set() and anyio.current_time() - start < 2.0


async def test_null_for_optional_param_means_default(ctx: ToolContext) -> None:
    @tool
    def window(start: int = 1, end: int | None = None) -> str:
        """Echo a window."""
        return f"{start}-{end}"

    registry = ToolRegistry([window])
    assert (await registry.call("window", {"start": None, "end": None}, ctx)).content == "1-None"
    assert (await registry.call("window", {"start": 4, "end": 9}, ctx)).content == "4-9"
    required_null = await ToolRegistry([add]).call("add", {"a": None}, ctx)
    assert required_null.is_error and "field 'a': None is not of type 'integer'" in required_null.content


class Base:
    @tool
    def zeta(self) -> str:
        """Defined first."""
        return "base-zeta"

    @tool
    def alpha(self) -> str:
        """Defined second."""
        return "alpha"


class Child(Base):
    @tool
    def zeta(self) -> str:
        """Overridden."""
        return "child-zeta"

    alpha = None  # type: ignore[assignment]  # a subclass can withdraw a tool

    @tool
    def beta(self) -> str:
        """Only in the child."""
        return "beta"


async def test_from_object_keeps_definition_order_and_overrides(ctx: ToolContext) -> None:
    registry = ToolRegistry.from_object(Child())
    assert registry.names == ["zeta", "beta"]
    assert (await registry.call("zeta", {}, ctx)).content == "child-zeta"


async def test_any_tool_output_is_capped(tmp_path: Path) -> None:
    @tool
    def flood() -> str:
        """Return far too much text."""
        return "A" * 50_000 + "B" * 1_000_000 + "C" * 50_000

    ctx = ToolContext(Workspace(tmp_path), max_output_chars=10_000)
    result = await ToolRegistry([flood]).call("flood", {}, ctx)
    assert len(result.content) < 12_100
    assert result.content.startswith("A" * 100) and result.content.endswith("C" * 100)
    assert "characters omitted ...]" in result.content


async def test_expected_duration_follows_measured_calls(ctx: ToolContext) -> None:
    @tool(expected_s=5.0)
    async def nap(seconds: float) -> str:
        """Sleep."""
        await anyio.sleep(seconds)
        return "ok"

    registry = ToolRegistry([nap])
    assert registry.expected_s("nap") == 5.0 and registry.expected_s("missing") is None
    await registry.call("nap", {"seconds": 0.2}, ctx)
    first = registry.expected_s("nap")
    assert first is not None and 0.2 <= first < 0.6
    await registry.call("nap", {"seconds": 0.0}, ctx)
    second = registry.expected_s("nap")
    assert second is not None and 0.1 < second < first  # moved toward the new measurement, not replaced by it


async def test_writing_tools_ask_for_approval(tmp_path: Path) -> None:
    asked: list[tuple[str, dict[str, object]]] = []

    async def approve(tool_: Tool, arguments: dict[str, object]) -> bool:
        asked.append((tool_.name, arguments))
        return arguments.get("path") != "protected.txt"

    ctx = ToolContext(Workspace(tmp_path), approve=approve)
    registry = ToolRegistry(coding_tools())
    ok = await registry.call("write_file", {"path": "free.txt", "content": "a"}, ctx)
    assert not ok.is_error and (tmp_path / "free.txt").read_text() == "a"
    declined = await registry.call("write_file", {"path": "protected.txt", "content": "a"}, ctx)
    assert declined.is_error and declined.content.startswith("The user declined to run 'write_file'")
    assert declined.data == {"declined": True} and not (tmp_path / "protected.txt").exists()
    listed = await registry.call("list_files", {}, ctx)  # read-only tools are never asked about
    assert not listed.is_error
    assert asked == [
        ("write_file", {"path": "free.txt", "content": "a"}),
        ("write_file", {"path": "protected.txt", "content": "a"}),
    ]
    invalid = await registry.call("write_file", {"path": 3}, ctx)  # invalid calls fail before anyone is asked
    assert invalid.is_error and len(asked) == 2
    sync_ctx = ToolContext(Workspace(tmp_path), approve=lambda tool_, arguments: False)  # plain callables work too
    assert (await registry.call("run_shell", {"command": "touch x"}, sync_ctx)).is_error
    assert not (tmp_path / "x").exists()


async def test_near_misses_get_suggestions(ctx: ToolContext) -> None:
    registry = ToolRegistry(coding_tools())
    unknown = await registry.call("readfile", {}, ctx)
    assert unknown.content.startswith("Unknown tool 'readfile'. Did you mean 'read_file'? Available tools: read_file,")
    renamed = await registry.call("edit_file", {"file_path": "a", "old_str": "x", "new_string": "y"}, ctx)
    assert renamed.is_error
    assert "missing required field 'old_string'; missing required field 'path'" in renamed.content
    assert "rename 'file_path' to 'path', 'old_str' to 'old_string'" in renamed.content


async def test_failing_permission_hook_blocks_the_call(tmp_path: Path) -> None:
    def broken(tool_: Tool, arguments: dict[str, object]) -> bool:
        raise RuntimeError("prompt window closed")

    ctx = ToolContext(Workspace(tmp_path), approve=broken)
    result = await ToolRegistry(coding_tools()).call("write_file", {"path": "a.txt", "content": "x"}, ctx)
    assert result.is_error and not (tmp_path / "a.txt").exists()
    assert "permission check failed (RuntimeError: prompt window closed)" in result.content
