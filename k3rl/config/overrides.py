"""`--set a.b.c=value`: one override applied to the loaded YAML before validation."""

from __future__ import annotations

from typing import Any

import yaml

from .base import ConfigError


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = _index(part, node, key)
            node = node[idx]
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_index(last, node, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override {item!r}: {'.'.join(parts[:-1])} is a value, not a section")


def _index(part: str, node: list, key: str) -> int:
    if not part.isdigit():
        raise ConfigError(f"override {key!r}: {part!r} must be a list index")
    idx = int(part)
    if idx == len(node):
        node.append({})
    if idx >= len(node):
        raise ConfigError(f"override {key!r}: index {idx} is past the end of a list of {len(node)}")
    return idx
