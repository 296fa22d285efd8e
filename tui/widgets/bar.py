"""A one-line horizontal bar as Content, shared by the gauges (a helper, not a widget)."""

from textual.content import Content

FULL, EMPTY = "█", "░"


def bar(
    fraction: float, width: int, style: str = "$success", empty_style: str = "$text-muted 40%"
) -> Content:
    """``fraction`` of ``width`` cells filled; values past 1 fill the whole bar."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return Content.assemble((FULL * filled, style), (EMPTY * (width - filled), empty_style))


def segments(parts: list[tuple[int, str]], total: int, width: int) -> Content:
    """A bar split in proportion to ``parts`` (count, style) out of ``total``, the rest empty."""
    if total <= 0:
        return bar(0.0, width)
    cells = [round(count / total * width) for count, _ in parts]
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    pieces: list[tuple[str, str] | str] = [
        (FULL * n, style) for n, (_, style) in zip(cells, parts, strict=True)
    ]
    pieces.append((EMPTY * (width - sum(cells)), "$text-muted 40%"))
    return Content.assemble(*pieces)
