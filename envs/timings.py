"""Wall-clock measurements carried in `info`, kept apart from the deterministic part of a step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class Timings(Mapping[str, float]):
    """Seconds per named phase of a step, e.g. {"parse": 1e-5, "tool:1:python": 0.21, "step": 0.22}.

    Durations are never reproducible, so two Timings compare equal when they time the same
    phases (same keys); read the values for the numbers. This keeps Gymnasium's determinism
    checks about the environment's behaviour, not about the machine's load.
    """

    def __init__(self, values: Mapping[str, float] | None = None) -> None:
        self._values: dict[str, float] = dict(values or {})

    def __getitem__(self, key: str) -> float:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __setitem__(self, key: str, seconds: float) -> None:
        self._values[key] = float(seconds)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timings):
            return list(self._values) == list(other._values)
        return NotImplemented

    __hash__ = None  # mutable

    def as_dict(self) -> dict[str, float]:
        return dict(self._values)

    def __repr__(self) -> str:
        return "Timings(" + ", ".join(f"{k}={v:.4f}s" for k, v in self._values.items()) + ")"
