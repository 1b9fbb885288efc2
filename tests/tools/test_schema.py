"""Schema generation from typed signatures and docstrings."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import jsonschema
import pydantic
import pytest
from freetoken_agent.tools import Tool, ToolContext, tool
from freetoken_agent.tools.schema import parse_docstring


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(pydantic.BaseModel):
    x: int
    y: int = 0


def test_google_docstring_gives_description_and_param_docs() -> None:
    @tool
    def read_file(ctx: ToolContext, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Read a file from disk.

        Shows line numbers.

        Args:
            path: File path, relative
                to the root.
            start_line (int): First line.
            end_line: Last line.

        Returns:
            The text.
        """
        return ""

    params = read_file.parameters
    assert read_file.name == "read_file"
    assert read_file.description == "Read a file from disk.\n\nShows line numbers."
    assert set(params["properties"]) == {"path", "start_line", "end_line"}  # ctx excluded by type
    assert params["required"] == ["path"]
    assert params["additionalProperties"] is False
    assert params["properties"]["path"] == {"type": "string", "description": "File path, relative to the root."}
    assert params["properties"]["start_line"]["default"] == 1
    assert params["properties"]["start_line"]["description"] == "First line."
    end_line = {"type": ["integer", "null"], "default": None, "description": "Last line."}
    assert params["properties"]["end_line"] == end_line
    assert "title" not in params and "title" not in params["properties"]["path"]
    assert read_file.schema() == {
        "type": "function",
        "function": {"name": "read_file", "description": read_file.description, "parameters": params},
    }
    jsonschema.Draft202012Validator.check_schema(params)


def test_rest_docstring_params() -> None:
    doc = parse_docstring(
        """Do a thing.

        :param name: The name
            of the thing.
        :param int count: How many.
        :returns: nothing
        """
    )
    assert doc.description == "Do a thing."
    assert doc.params == {"name": "The name of the thing.", "count": "How many."}


def test_rich_types_become_schema() -> None:
    @tool(name="paint", writes=True, expected_s=2.5, kind="edit")
    def paint_points(
        points: list[Point],
        color: Color,
        mode: Literal["fill", "stroke"] = "fill",
        tags: dict[str, int] | None = None,
        width: Annotated[float, pydantic.Field(gt=0)] = 1.0,
    ) -> str:
        """Paint points."""
        return ""

    params = paint_points.parameters
    assert paint_points.name == "paint" and paint_points.writes and paint_points.expected_s == 2.5
    assert paint_points.kind == "edit"
    assert params["required"] == ["points", "color"]
    assert params["properties"]["mode"]["enum"] == ["fill", "stroke"]
    assert params["properties"]["width"]["exclusiveMinimum"] == 0
    assert params["properties"]["tags"]["type"] == ["object", "null"]
    assert params["properties"]["tags"]["additionalProperties"] == {"type": "integer"}
    point = params["$defs"]["Point"]
    assert point["additionalProperties"] is False and point["required"] == ["x"]
    validator = jsonschema.Draft202012Validator(params)
    assert validator.is_valid({"points": [{"x": 1}], "color": "red"})
    assert not validator.is_valid({"points": [{"x": 1, "z": 2}], "color": "red"})
    assert not validator.is_valid({"points": [], "color": "green"})
    assert not validator.is_valid({"points": [], "color": "red", "mode": "dots"})


def test_keyword_named_parameters_survive_cleaning() -> None:
    @tool
    def rename(title: str, type: str, anyOf: int | None = None, description: str = "") -> str:  # noqa: A002, N803
        """Set a title."""
        return title

    assert list(rename.parameters["properties"]) == ["title", "type", "anyOf", "description"]
    assert rename.parameters["properties"]["title"] == {"type": "string"}
    assert rename.parameters["properties"]["anyOf"]["type"] == ["integer", "null"]
    assert rename.parameters["required"] == ["title", "type"]


def test_no_arguments_and_defaults_to_other_kind() -> None:
    @tool
    def now() -> str:
        """The time."""
        return "noon"

    assert now.parameters == {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    assert now.kind == "other" and now.writes is False and now.expected_s is None
    assert now() == "noon"  # a Tool stays callable like its function


def test_writes_implies_edit_kind_and_description_override() -> None:
    @tool(writes=True, description="Custom text.")
    def save(data: str) -> None:
        """Ignored docstring."""

    assert save.kind == "edit" and save.description == "Custom text."


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f(*args: int) -> str: return ''", "*args/**kwargs"),
        ("def f(**kw: int) -> str: return ''", "*args/**kwargs"),
        ("def f(a: int, /) -> str: return ''", "positional-only"),
        ("def f(a: 'Missing') -> str: return ''", "cannot resolve type hints"),
        ("import threading\ndef f(lock: threading.Lock) -> str: return ''", "cannot be expressed as JSON Schema"),
        ("from typing import Callable\ndef f(cb: Callable[[], int]) -> str: return ''", "cannot be expressed"),
    ],
)
def test_unsupported_signatures_fail_at_definition(source: str, message: str) -> None:
    namespace: dict[str, object] = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match=message.replace("*", r"\*")):
        Tool(namespace["f"])  # type: ignore[arg-type]


def test_bad_name_and_kind_rejected() -> None:
    def f() -> str:
        return ""

    with pytest.raises(TypeError, match="letters"):
        Tool(f, name="has space")
    with pytest.raises(TypeError, match="kind must be one of"):
        Tool(f, kind="delete")  # type: ignore[arg-type]
