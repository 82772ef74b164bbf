"""Short, fixed-width-friendly renderings of rates, durations and errors for the panels."""
from __future__ import annotations

from engine.errors import TokentopError


def fmt_rate(tps: float) -> str:
    """Tokens per second: 0, 37, 293, 2.6k, 18k."""
    if tps < 1:
        return "0" if tps <= 0 else f"{tps:.1f}"
    if tps < 1000:
        return f"{tps:.0f}"
    if tps < 10_000:
        return f"{tps / 1000:.1f}k"
    return f"{tps / 1000:.0f}k"


def fmt_seconds(seconds: float | None) -> str:
    """A latency: 'ms' below a second, then seconds, then minutes; '-' when unknown."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def short_model(model: str) -> str:
    """A catalog name stays; a path shows only its file name."""
    return model.replace("\\", "/").rsplit("/", 1)[-1]


def describe_error(exc: BaseException) -> str:
    """A TokentopError is written for users as is; anything else also names its type."""
    return str(exc) if isinstance(exc, TokentopError) else f"{type(exc).__name__}: {exc}"
