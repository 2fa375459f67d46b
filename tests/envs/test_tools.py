"""Tool declarations: typed functions and pydantic models -> JSON schema, argument validation, results."""

import pytest
from PIL import Image
from pydantic import BaseModel, Field

from k3rl.envs import Tool, ToolArgumentError, ToolResult, tool
from k3rl.images import PNG_MAGIC


@tool
def move(x: int, y: int = 0, speed: float = 1.0, label: str | None = None) -> str:
    """Move the cursor to a cell.

    Longer explanation that is not part of the description.

    Args:
        x: column, 0-based.
        y: row, 0-based;
            defaults to the top row.
        speed: cells per step.
    """
    return f"{x},{y}"


def test_schema_from_type_hints_and_docstring():
    s = move.schema()
    assert s["type"] == "function"
    f = s["function"]
    assert f["name"] == "move" and f["description"] == "Move the cursor to a cell."
    props = f["parameters"]["properties"]
    assert props["x"] == {"type": "integer", "description": "column, 0-based."}
    assert props["y"]["default"] == 0 and props["y"]["description"] == "row, 0-based; defaults to the top row."
    assert props["speed"]["type"] == "number"
    assert f["parameters"]["required"] == ["x"]
    assert "title" not in str(s)  # pydantic's titles are stripped (prompt tokens)


def test_validation_names_every_problem():
    assert move.validate({"x": 3}) == {"x": 3, "y": 0, "speed": 1.0, "label": None}
    with pytest.raises(ToolArgumentError) as e:
        move.validate({"y": "down", "z": 1})
    msg = str(e.value)
    assert "bad arguments for move" in msg and "x: Field required" in msg
    assert "y: " in msg and "z: Extra inputs are not permitted" in msg
    assert "Expected (x: integer" in msg
    with pytest.raises(ToolArgumentError, match="must be an object"):
        move.validate(["x"])


def test_missing_type_hint_is_a_clear_error():
    def f(a, b: int):
        return a

    with pytest.raises(TypeError, match="parameter 'a' needs a type hint"):
        Tool(f)
    with pytest.raises(ValueError, match="tool name"):
        Tool(lambda q: q, name="has space")


def test_pydantic_model_tool():
    class Search(BaseModel):
        """Search the notes."""

        query: str = Field(description="words to find")
        limit: int = Field(5, ge=1, le=50)

    t = Tool.from_model(Search, lambda query, limit: f"{query}:{limit}", name="search")
    assert t.schema()["function"]["description"] == "Search the notes."
    assert t.schema()["function"]["parameters"]["properties"]["limit"]["maximum"] == 50
    assert t.fn(**t.validate({"query": "k3"})) == "k3:5"
    with pytest.raises(ToolArgumentError, match="limit: Input should be less than or equal to 50"):
        t.validate({"query": "k3", "limit": 99})


def test_method_tools_bind_and_stay_callable():
    class Box:
        def __init__(self):
            self.n = 2

        @tool
        def times(self, k: int) -> int:
            """Multiply."""
            return self.n * k

    b = Box()
    assert b.times(4) == 8  # still an ordinary method
    bound = Box.times.bind(b)
    assert bound.fn(**bound.validate({"k": 5})) == 10
    assert "self" not in bound.schema()["function"]["parameters"]["properties"]


def test_tool_result_coercion():
    png = ToolResult.coerce(Image.new("RGB", (3, 2))).images[0]
    assert png.startswith(PNG_MAGIC)
    assert ToolResult.coerce(png).images == [png]
    assert ToolResult.coerce({"b": 1, "a": [1, 2]}).text == '{"a": [1, 2], "b": 1}'
    assert ToolResult.coerce(None).text == ""
    with pytest.raises(TypeError, match="return str, PNG bytes"):
        ToolResult.coerce(object())
