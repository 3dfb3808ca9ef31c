"""The checks every section of the schema shares: each appends (field, what is wrong and what is allowed) to a
list instead of raising, so a bad config reports all of its mistakes at once, each under its full dotted key."""

from __future__ import annotations

from typing import List

Problems = List[tuple]  # (field name, what is wrong and what is allowed)


def choice(problems: Problems, name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        problems.append((name, f"got {value!r}; allowed: {', '.join(allowed)}"))


def positive(problems: Problems, name: str, value: float) -> None:
    if not value > 0:
        problems.append((name, f"got {value!r}; must be > 0"))


def in_range(problems: Problems, name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        problems.append((name, f"got {value!r}; must be between {low} and {high}"))


def at_most(problems: Problems, name: str, value: float, high: float, why: str) -> None:
    """Refuse a count or size past what any run could use. Such a value is a typo (an extra digit, a byte count,
    a unit slip) that would otherwise start days of work or ask for memory no machine has, and fail far from
    the key that caused it, or never."""
    if value > high:
        problems.append((name, f"got {number(value)}; at most {number(high)} {why}"))


def number(value: float) -> str:
    """A count as typed (`65537`), a float without a trailing `.0` (`101`, `1e+12`)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def bounded(problems: Problems, section, bounds: tuple) -> None:
    """`at_most` for each (field, bound, why) of a section's table of upper bounds."""
    for name, high, why in bounds:
        value = getattr(section, name)
        at_most(problems, name, len(value) if isinstance(value, (list, dict)) else value, high, why)


def increasing(problems: Problems, name: str, values: List[float], count: int) -> None:
    if len(values) != count or any(b <= a for a, b in zip(values, values[1:])):
        problems.append((name, f"got {list(values)!r}; expected {count} increasing numbers"))
