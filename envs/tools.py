"""Tools declared as typed Python functions.

    class MyEnv(ToolEnv):
        @tool
        def lookup(self, key: str) -> str:
            '''Return the value stored under a key.

            Args:
                key: the key to look up, e.g. "k3".
            '''
            ...

The type hints become a pydantic model, its JSON schema goes into the tool declaration of
the chat template (OpenAI-style: `{"type": "function", "function": {name, description,
parameters}}`), and every call's arguments are validated against the model before the
function runs. The first docstring paragraph is the description; Google-style `Args:` lines
describe the parameters. A pydantic model works too: `Tool.from_model(Args, fn)`.

A tool returns a `str`, PNG `bytes`, a PIL image, any JSON-able value, or a `ToolResult`
(text + images, and optionally `done`/`reward` to end the episode). Raise `ToolError` for an
expected failure: its message goes back to the model as the tool's (error) result.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from k3rl.images import to_png

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class ToolError(Exception):
    """Raise inside a tool for an expected failure; the message is shown to the model."""


class ToolArgumentError(ValueError):
    """A call's arguments do not match the tool's declared parameters; the message is for the model."""


@dataclass
class ToolResult:
    """What a tool gives back: text, PNG images, and optionally the end of the episode.

    `done=True` ends the episode after this call with `reward` as the terminal reward
    (an explicit `submit`-style tool). `error=True` marks the text as an error message.
    """

    text: str = ""
    images: list[bytes] = field(default_factory=list)
    error: bool = False
    done: bool = False
    reward: float = 0.0

    @classmethod
    def coerce(cls, value: Any) -> ToolResult:
        """Turn whatever a tool returned into a ToolResult."""
        if isinstance(value, ToolResult):
            return value
        if value is None:
            return cls("")
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, (bytes, bytearray)):
            return cls("", [to_png(bytes(value))])
        if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image
            return cls("", [to_png(value)])
        try:
            return cls(json.dumps(value, ensure_ascii=False, sort_keys=True))
        except TypeError:
            raise TypeError(
                f"a tool returned a {type(value).__name__}; return str, PNG bytes, a PIL image, "
                "a JSON-able value or a ToolResult"
            ) from None


def _split_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    parts = re.split(r"\n\s*\n", doc, maxsplit=1)
    description = " ".join(parts[0].split())
    params: dict[str, str] = {}
    m = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.M)
    if m:
        current = None
        for line in m.group(1).splitlines():
            pm = re.match(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if pm:
                current = pm.group(1)
                params[current] = pm.group(2).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return description, params


def _strip_titles(schema: Any) -> Any:
    """Drop pydantic's auto-generated "title" keys: they cost prompt tokens and say nothing new."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "title" and isinstance(v, str):
                continue
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                out[k] = {name: _strip_titles(sub) for name, sub in v.items()}
            else:
                out[k] = _strip_titles(v)
        return out
    if isinstance(schema, list):
        return [_strip_titles(x) for x in schema]
    return schema


class Tool:
    """A callable the model may invoke: name, description, argument model, function.

    Used as a decorator on ToolEnv methods (`@tool`), it is a descriptor: `env.lookup` is the
    plain bound method, and the env collects the declared tools through `bind(env)`.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 args_model: type[BaseModel] | None = None, is_method: bool | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match {_NAME.pattern} (letters, digits, _ . -)")
        doc_description, doc_params = _split_docstring(fn.__doc__)
        self.description = description if description is not None else doc_description
        params = list(inspect.signature(fn).parameters.values())
        if is_method is None:
            is_method = bool(params) and params[0].name == "self"
        self.is_method = is_method
        self._owner: Any = None
        self.args_model = args_model or self._model_from_signature(fn, params[1:] if is_method else params, doc_params)

    def _model_from_signature(self, fn, params, doc_params) -> type[BaseModel]:
        hints = typing.get_type_hints(fn)
        fields: dict[str, Any] = {}
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {self.name!r}: *args/**kwargs cannot be declared to a model; name each parameter")
            if p.name not in hints:
                raise TypeError(f"tool {self.name!r}: parameter {p.name!r} needs a type hint (it becomes the JSON schema)")
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (hints[p.name], Field(default, description=doc_params.get(p.name) or None))
        return create_model(f"{self.name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)

    @classmethod
    def from_model(cls, args_model: type[BaseModel], fn: Callable[..., Any], *, name: str | None = None,
                   description: str | None = None) -> Tool:
        """A tool whose arguments are the fields of `args_model`; `fn` receives them as keywords."""
        return cls(fn, name=name, description=description or (args_model.__doc__ or "").strip().split("\n\n")[0],
                   args_model=args_model, is_method=False)

    # -- descriptor: `@tool` on a method keeps `env.method(...)` an ordinary call -------------
    def __set_name__(self, owner, attr) -> None:
        self._owner = owner

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype) if self.is_method else self.fn

    def bind(self, obj: Any) -> Tool:
        """A copy whose function has `obj` as `self` (for tools declared on a class)."""
        bound = object.__new__(Tool)
        bound.__dict__.update(self.__dict__)
        if self.is_method:
            bound.fn = self.fn.__get__(obj, type(obj))
            bound.is_method = False
        return bound

    # -- schema and calls --------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, Any]:
        schema = _strip_titles(self.args_model.model_json_schema())
        schema.pop("additionalProperties", None)
        return schema

    def schema(self) -> dict[str, Any]:
        """The declaration the chat template puts in the prompt."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Checked keyword arguments, or ToolArgumentError naming every problem."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments of {self.name} must be an object, got {type(arguments).__name__}")
        try:
            model = self.args_model.model_validate(arguments)
        except ValidationError as e:
            problems = []
            for err in e.errors():
                where = ".".join(str(x) for x in err["loc"]) or "(arguments)"
                problems.append(f"{where}: {err['msg']}")
            expected = ", ".join(
                f"{k}: {v.get('type', 'any')}" for k, v in self.parameters.get("properties", {}).items()
            )
            raise ToolArgumentError(
                f"bad arguments for {self.name}: " + "; ".join(problems) + f". Expected ({expected})."
            ) from None
        return {name: getattr(model, name) for name in type(model).model_fields}

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Declare a function or ToolEnv method as a tool: `@tool` or `@tool(name=..., description=...)`."""
    if fn is None:
        return lambda f: Tool(f, name=name, description=description)
    return Tool(fn, name=name, description=description)


def collect_tools(obj: Any) -> list[Tool]:
    """The `@tool` members of `obj`'s class (base classes first, overrides win), bound to `obj`."""
    found: dict[str, Tool] = {}
    for klass in reversed(type(obj).__mro__):
        for attr, value in vars(klass).items():
            if isinstance(value, Tool):
                found.pop(attr, None)
                found[attr] = value
            elif attr in found:  # overridden by a non-tool: no longer a tool
                found.pop(attr)
    return [t.bind(obj) for t in found.values()]
