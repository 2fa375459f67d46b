"""What every section shares: unknown keys refused, cross-field checks that name the bad field
(`FieldProblems`), and `ConfigError`, whose message gives each bad field by its dotted path."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FieldProblems(ValueError):
    """Raised by a cross-field check: (dotted path relative to the section, what is wrong and what to do)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{path}: {message}" for path, message in problems))


def _refuse(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise FieldProblems(problems)


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad field by its dotted path."""


def _format(error: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        path = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "<root>")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblems):  # a cross-field check: paths relative to the section that raised it
            base = ".".join(p for p in (prefix, loc) if p)
            lines += [f"{base}.{field}: {message}" if base else f"{field}: {message}" for field, message in cause.problems]
        elif err["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key (check the spelling; `k3rl config show` prints every valid key)")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {err['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)
