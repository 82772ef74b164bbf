"""Short, fixed-width-friendly renderings of rates, durations and sizes for the panels."""
from __future__ import annotations

import functools

from rich.cells import cell_len

from engine.outside import visible


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


def fmt_mib(num_bytes: int | float) -> str:
    """Memory in MiB below a GiB, then GiB: '12 MiB', '612 MiB', '2.4 GiB'."""
    mib = num_bytes / 2**20
    if mib >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.1f} MiB" if mib < 10 else f"{mib:.0f} MiB"


def fmt_uptime(seconds: float) -> str:
    """'42s', '3m05s', '2h07m'."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def outside_markup(text: object, *, multiline: bool = False) -> str:
    """Text from outside (a client, a recording, a server, a file name) for a place in a markup
    string: its control characters in caret notation, its brackets taken as text, not tags.
    Every bracket is escaped: textual.markup.escape leaves those that do not look like a tag,
    and "[2J" then swallows the closing tag after it."""
    shown = visible(text, multiline=multiline).replace("[", "\\[")
    # Textual's markup has no escape for a backslash before a tag: a zero-width space keeps a
    # final one from escaping the tag that follows
    return shown + "\u200b" if shown.endswith("\\") else shown


def short_worker(name: str) -> str:
    """A worker's name without the 'sim:' prefix: 'cpu', 'gpu0', 'cuda:1'."""
    return name[4:] if name.startswith("sim:") else name


def fit_parts(parts: list[tuple[int, str]], width: int, sep: str = " · ") -> str:
    """Join (priority, markup) parts, kept in order, dropping the lowest-priority ones
    (highest number) until the visible text fits `width` cells. Priority-0 parts and the
    first part always stay (a Line then cuts what is still too long with an ellipsis)."""
    joined = sep.join(markup for _, markup in parts)
    if cell_len(joined) <= width:
        return joined     # fits with its tags counted: no need to work out the visible widths
    lengths = [markup_cells(markup) for _, markup in parts]
    keep = list(range(len(parts)))
    def visible() -> int:
        return sum(lengths[i] for i in keep) + len(sep) * max(0, len(keep) - 1)
    for i in sorted((i for i in range(1, len(parts)) if parts[i][0] > 0), key=lambda i: (-parts[i][0], -i)):
        if width <= 0 or visible() <= width:
            break
        keep.remove(i)
    return sep.join(parts[i][1] for i in keep)


@functools.lru_cache(maxsize=4096)
def markup_cells(markup: str) -> int:
    """The cells a markup string shows (its tags and escapes are not shown). Most of the
    dashboard's parts come back unchanged refresh after refresh: each is parsed once."""
    from textual.content import Content

    return Content.from_markup(markup).cell_length
