"""``@tool`` and ``Tool``: a typed function the model can call, with validated arguments.

Every failure a model can cause (arguments that are not JSON, arguments that break the schema, a tool that raises)
comes back from :meth:`Tool.invoke` as a :class:`ToolResult` with ``is_error=True`` and a message written for the
model; ``invoke`` itself never raises for them.
"""

from __future__ import annotations

import functools
import inspect
import json
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, overload

import anyio
import anyio.to_thread
import jsonschema
import pydantic
from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
from freetoken_agent.tools.schema import build_signature
from freetoken_agent.tools.validation import (
    describe_parameters,
    jsonschema_errors,
    non_finite_errors,
    pydantic_errors,
)

ToolKind = Literal["read", "edit", "execute", "search", "other"]
KINDS: tuple[str, ...] = ("read", "edit", "execute", "search", "other")
F = TypeVar("F", bound=Callable[..., Any])


def _checked_kind(name: str, writes: bool, kind: ToolKind | None) -> ToolKind:
    """Validate a tool name and return its kind (``edit`` for writing tools unless given)."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise TypeError(f"tool name {name!r} must contain only letters, digits, '_' and '-'")
    resolved = kind or ("edit" if writes else "other")
    if resolved not in KINDS:
        raise TypeError(f"tool {name!r}: kind must be one of {', '.join(KINDS)}, got {resolved!r}")
    return resolved


class Tool:
    """A function the model can call: its name, description, JSON Schema for arguments and permission metadata.

    A ``Tool`` is still callable like the function it wraps. Used as a method decorator it binds like a method.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        writes: bool = False,
        kind: ToolKind | None = None,
        expected_s: float | None = None,
    ) -> None:
        self.fn = fn
        self.name: str = name or fn.__name__
        resolved_kind = _checked_kind(self.name, writes, kind)
        sig = build_signature(fn, self.name, description)
        self.description: str = sig.description
        self.parameters: dict[str, Any] = sig.parameters
        self.args_model: type[pydantic.BaseModel] | None = sig.model
        self.context_param: str | None = sig.context_param
        self.writes: bool = writes
        self.kind: ToolKind = resolved_kind
        self.expected_s: float | None = expected_s
        self.stream_prefix: Callable[[str], str] | None = None
        """For a tool whose output streams (``ctx.on_output``): the output so far → the text its result will start
        with (the agent loop lets a local engine prefill that while the tool runs)."""
        self.is_async: bool = inspect.iscoroutinefunction(fn)
        self._validator = jsonschema.Draft202012Validator(self.parameters)
        self._null_means_default: frozenset[str] = frozenset(
            key
            for key, spec in self.parameters["properties"].items()
            if "default" in spec and not self._validator.evolve(schema=spec).is_valid(None)
        )
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    @classmethod
    def from_schema(
        cls,
        name: str,
        description: str,
        parameters: dict[str, Any],
        call: Callable[[dict[str, Any]], Awaitable[Any]],
        *,
        writes: bool = False,
        kind: ToolKind | None = None,
        expected_s: float | None = None,
    ) -> Tool:
        """A tool defined by a ready JSON Schema (e.g. from an MCP server) and ``call(arguments) -> result``.

        Arguments are validated with ``jsonschema`` only (there is no pydantic model); ``call`` gets the dict.
        """
        resolved_kind = _checked_kind(name, writes, kind)
        jsonschema.Draft202012Validator.check_schema(parameters)
        made = object.__new__(cls)
        made.fn = call
        made.name = name
        made.description = description
        made.parameters = {"type": "object", "properties": {}, **parameters}
        made.args_model = None
        made.context_param = None
        made.writes = writes
        made.kind = resolved_kind
        made.expected_s = expected_s
        made.is_async = True
        made._validator = jsonschema.Draft202012Validator(made.parameters)
        made._null_means_default = frozenset()
        return made

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, kind={self.kind!r}, writes={self.writes})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __get__(self, obj: Any, objtype: type | None = None) -> Tool:
        if obj is None:
            return self
        return self.bind(obj)

    def bind(self, obj: Any) -> Tool:
        """A copy of this tool whose function is bound to ``obj`` (for tools declared as methods)."""
        bound = object.__new__(Tool)
        bound.__dict__.update(self.__dict__)
        bound.fn = self.fn.__get__(obj, type(obj))
        return bound

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool definition: ``{"type": "function", "function": {name, description, ...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def invoke(self, arguments: dict[str, Any] | str | None, ctx: ToolContext | None) -> ToolResult:
        """Validate ``arguments`` and run the tool; every failure becomes an error :class:`ToolResult`."""
        args = _decode_arguments(self, arguments)
        if isinstance(args, ToolResult):
            return args
        args = self._drop_null_defaults(args)
        errors = non_finite_errors(args) or jsonschema_errors(self._validator, args)
        if errors:
            return ToolResult.error(_invalid(self, errors))
        try:
            allowed = ctx is None or await ctx.allowed(self, args)
        except Exception as exc:  # the client's permission hook failed: do not run the tool, and say why
            return ToolResult.error(
                f"Tool '{self.name}' was not run: the permission check failed ({type(exc).__name__}: {exc})."
            )
        if not allowed:
            return ToolResult.error(
                f"The user declined to run '{self.name}' with these arguments. Do not retry the same call; "
                "choose another approach or ask the user.",
                data={"declined": True},
            )
        if self.args_model is None:  # a schema-only tool (MCP): the callable takes the validated dict
            call: Callable[[], Any] = functools.partial(self.fn, args)
        else:
            try:
                parsed = self.args_model.model_validate(args)
            except pydantic.ValidationError as exc:
                return ToolResult.error(_invalid(self, pydantic_errors(exc)))
            kwargs = {key: getattr(parsed, key) for key in type(parsed).model_fields}
            if self.context_param is not None:
                if ctx is None:
                    return ToolResult.error(f"Tool '{self.name}' needs a ToolContext but none was given.")
                kwargs[self.context_param] = ctx
            call = functools.partial(self.fn, **kwargs)
        try:
            if self.is_async:
                value = await call()
            else:
                value = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        except ToolError as exc:
            return ToolResult.error(f"Error from tool '{self.name}': {exc}")
        except Exception as exc:  # a bug or an unexpected condition inside the tool: the model still gets a message
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return ToolResult.error(
                f"Tool '{self.name}' failed with {type(exc).__name__}: {exc} "
                f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
            )
        return _cap(_to_result(value), ctx)

    def _drop_null_defaults(self, args: dict[str, Any]) -> dict[str, Any]:
        """Treat ``null`` for an optional parameter that does not accept null as "use the default".

        Models trained on OpenAI strict mode send every parameter and use null for the ones they skip.
        """
        return {key: value for key, value in args.items() if not (value is None and key in self._null_means_default)}


def _decode_arguments(tool: Tool, arguments: dict[str, Any] | str | None) -> dict[str, Any] | ToolResult:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolResult.error(
                f"Invalid arguments for tool '{tool.name}': not valid JSON ({exc.msg} at line {exc.lineno} "
                f"column {exc.colno}). Send one JSON object. {describe_parameters(tool.parameters)}"
            )
        if isinstance(arguments, str) and arguments.lstrip().startswith("{"):
            try:  # an object encoded twice (some models quote the whole argument object)
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
    if not isinstance(arguments, dict):
        return ToolResult.error(
            f"Invalid arguments for tool '{tool.name}': expected a JSON object, got {type(arguments).__name__}. "
            f"{describe_parameters(tool.parameters)}"
        )
    return arguments


def _invalid(tool: Tool, errors: list[str]) -> str:
    listed = "; ".join(errors)
    return f"Invalid arguments for tool '{tool.name}': {listed}. {describe_parameters(tool.parameters)}"


CAP_SLACK_CHARS = 2000  # room for a tool's own headers and notes around capped output


def _cap(result: ToolResult, ctx: ToolContext | None) -> ToolResult:
    """Keep the head and tail of content longer than the context's cap, so no tool can flood the model."""
    limit = (ctx.max_output_chars if ctx is not None else ToolContext.max_output_chars) + CAP_SLACK_CHARS
    text = result.content
    if len(text) <= limit:
        return result
    half = limit // 2
    omitted = len(text) - 2 * half
    result.content = f"{text[:half]}\n[... {omitted} characters omitted ...]\n{text[-half:]}"
    return result


def _to_result(value: Any) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult(content="(no output)")
    if isinstance(value, str):
        return ToolResult(content=value)
    if isinstance(value, pydantic.BaseModel):
        return ToolResult(content=value.model_dump_json(), data=value.model_dump(mode="json"))
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = str(value)
    return ToolResult(content=text, data=value if isinstance(value, dict) else None)


@overload
def tool(fn: F, /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    writes: bool = False,
    kind: ToolKind | None = None,
    expected_s: float | None = None,
) -> Callable[[F], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    writes: bool = False,
    kind: ToolKind | None = None,
    expected_s: float | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a :class:`Tool` from a typed function: ``@tool`` or ``@tool(name=..., writes=True, expected_s=...)``.

    The docstring's text before its sections is the description; its ``Args:`` section describes the parameters.
    A parameter annotated :class:`ToolContext` receives the call's context and is hidden from the schema.
    """

    def wrap(func: Callable[..., Any]) -> Tool:
        return Tool(func, name=name, description=description, writes=writes, kind=kind, expected_s=expected_s)

    return wrap(fn) if fn is not None else wrap
