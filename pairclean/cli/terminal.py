"""The one way text reaches the terminal: consoles that print every string literally, and tables
that stay readable at any width.

Captions, keys, paths, predicates and query results come from the user's data. `LiteralConsole`
never parses a string as rich markup or emoji codes (`'[/bold]'` is printed, not a crash;
`[link=...]` is printed, not a hidden link) and shows control and bidirectional-format
characters by their code points, `<U+202E>` (`ops.text.visible`: an escape sequence or a right-to-left override in a
key cannot rewrite the line). pairclean's own emphasis is a `style=` or a `rich.text.Text` built
here, never markup inside a string.

`print_table` is how every command shows a table:
* to a terminal, the rich table when it fits the width with every number whole and every text
  column wrapped only at spaces; when it cannot, one block per row (`column  value` lines), so a
  narrow terminal never cuts numbers to "…" or folds cells into columns of a few characters;
* to anything else (a pipe, a file, CI), plain text: a header and one line per row, columns
  aligned, nothing cut. Where the environment says its width (`COLUMNS`: a log, CI), text
  columns are wrapped at spaces to fit it (numbers stay whole), else each row is one block of
  `column  value` lines; without `COLUMNS` a line is as wide as its cells need.
"""

from __future__ import annotations

import os
import textwrap

from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from pairclean.ops.text import visible

GAP = "  "  # between the columns of a plain table


class LiteralConsole(Console):
    """A console that prints strings as they are: no markup, no emoji codes, hidden characters shown,
    and a line is never broken by pairclean (a terminal wraps it; a pipe gets it whole, so a path
    printed at the end of a line can be copied)."""

    def __init__(self, **kwargs):
        super().__init__(markup=False, emoji=False, highlight=False, soft_wrap=True, **kwargs)

    def render_str(self, text: str, **kwargs) -> Text:
        kwargs.update(markup=False, emoji=False)
        return super().render_str(visible(text), **kwargs)


def literal(text: str, style: str = "") -> Text:
    """Data text as a rich Text (for the places that build Text themselves), hidden characters shown."""
    return Text(visible(str(text)), style=style)


def _plain(cell: RenderableType) -> str:
    if isinstance(cell, Text):
        return visible(cell.plain)
    return visible(str(cell))


def _columns(table: Table) -> list[tuple[str, str, list[str]]]:
    """(header, justify, cell texts) per column."""
    return [(_plain(c.header), c.justify, [_plain(cell) for cell in c._cells]) for c in table.columns]


def _width(text: str) -> int:
    return max((cell_len(line) for line in text.split("\n")), default=0)


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


def _wrapped(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` cells, cut at spaces only (a longer word stays whole)."""
    return textwrap.wrap(text, max(width, 1), break_long_words=False, break_on_hyphens=False) or [""]


def plain_lines(table: Table, width: int | None = None) -> list[str]:
    """The table as plain text: title, header, one line per row (a header cut in lines is joined).
    `width`: the lines fit it, text columns wrapped at spaces (`_narrowed`), else one block per
    row (`plain_records`)."""
    columns = [(header.replace("\n", " "), justify, [cell.replace("\n", " ") for cell in cells])
               for header, justify, cells in _columns(table)]
    rows = ([[header for header, _, _ in columns]] if table.show_header else []) + \
        [list(row) for row in zip(*(cells for _, _, cells in columns))]
    widths = [max(cell_len(row[i]) for row in rows) if rows else 0 for i in range(len(columns))]
    if width is not None and sum(widths) + len(GAP) * (len(widths) - 1) > width:
        narrowed = _narrowed(columns, rows, widths, width)
        if narrowed is None:
            return plain_records(table, width)
        widths = narrowed

    def lines(row: list[str]) -> list[str]:
        cut = [_wrapped(cell, w) if cell_len(cell) > w else [cell] for cell, w in zip(row, widths)]
        out = []
        for depth in range(max(len(c) for c in cut)):
            cells = [(c[depth] if depth < len(c) else "") for c in cut]
            out.append(GAP.join(cell.rjust(w + len(cell) - cell_len(cell)) if columns[i][1] == "right"
                                else cell.ljust(w + len(cell) - cell_len(cell))
                                for i, (cell, w) in enumerate(zip(cells, widths))).rstrip())
        return out

    out = [_plain(table.title)] if table.title else []
    out += [line for row in rows for line in lines(row)]
    if table.caption:
        out.append(_plain(table.caption))
    return out


def _narrowed(columns: list, rows: list[list[str]], widths: list[int], width: int) -> list[int] | None:
    """Column widths within `width`: the widest text column narrowed first, none below its longest
    word, numbers (right-aligned columns) whole; None when they cannot fit."""
    floor = [max((_longest_word(row[i]) for row in rows), default=0) if justify != "right" else widths[i]
             for i, (_, justify, _) in enumerate(columns)]
    widths = list(widths)
    excess = sum(widths) + len(GAP) * (len(widths) - 1) - width
    while excess > 0:
        i = max(range(len(widths)), key=lambda j: widths[j] - floor[j])
        cut = min(excess, widths[i] - floor[i])
        if cut <= 0:
            return None
        widths[i] -= cut
        excess -= cut
    return widths


def plain_records(table: Table, width: int) -> list[str]:
    """The table as plain text in `width`: one block per row, each column's name and its value
    (wrapped at spaces, under the name when the names leave it too little room)."""
    columns = _columns(table)
    names = [header.replace("\n", " ") if table.show_header else "" for header, _, _ in columns]
    label = max(map(cell_len, names), default=0)
    beside = width - label - len(GAP) >= max(20, width // 2)
    out = [_plain(table.title)] if table.title else []
    for number, row in enumerate(zip(*(cells for _, _, cells in columns)), 1):
        out.append(f"-- row {number} --" if table.show_header else "--")
        for name, cell in zip(names, row):
            cell = cell.replace("\n", " ")
            if beside:
                for depth, line in enumerate(_wrapped(cell, width - label - len(GAP))):
                    out.append(f"{(name if depth == 0 else '').ljust(label)}{GAP}{line}".rstrip())
            else:
                out += ([name] if name else []) + [f"    {line}" for line in _wrapped(cell, width - 4)]
    if table.caption:
        out.append(_plain(table.caption))
    return out


def _given_width() -> int | None:
    """The width the environment gives output that is not a terminal (`COLUMNS`), or None."""
    try:
        return int(os.environ["COLUMNS"]) if int(os.environ.get("COLUMNS", "0")) > 0 else None
    except ValueError:
        return None


def _fits(table: Table, width: int) -> bool:
    """Whether the rich table fits `width` with numbers (right-aligned columns) whole and text
    columns wrapped at spaces only."""
    need = 0
    for header, justify, cells in _columns(table):
        texts = [header, *cells]
        need += max(_width(t) if justify == "right" else _longest_word(t) for t in texts) + 2  # + padding
    return need + len(table.columns) + 1 <= width  # + the vertical rules


def _records(table: Table) -> list[RenderableType]:
    """One block per row: each column's name with its value (a table without a header: a row's
    cells on one wrapped line)."""
    columns = _columns(table)
    blocks: list[RenderableType] = [Text(_plain(table.title), style="bold")] if table.title else []
    for number, row in enumerate(zip(*(cells for _, _, cells in columns)), 1):
        if not table.show_header:
            blocks.append(Text(GAP.join(cell for cell in row if cell)))
            continue
        block = Table.grid(padding=(0, 2))
        block.add_column(style="bold", no_wrap=True)
        block.add_column(overflow="fold")
        for (header, _, _), cell in zip(columns, row):
            block.add_row(header.replace("\n", " "), cell)
        blocks += [Text(f"-- row {number} --", style="dim"), block]
    if table.caption:
        blocks.append(Text(_plain(table.caption), style="dim"))
    return blocks


def print_table(console: Console, table: Table) -> None:
    """Show `table` readably (see the module docstring)."""
    if not console.is_terminal:
        for line in plain_lines(table, _given_width()):
            console.out(line, highlight=False)
        return
    if _fits(table, console.width):
        for column in table.columns:
            column.no_wrap = column.justify == "right"
            column.overflow = "fold"
        console.print(table, soft_wrap=False)
        return
    for block in _records(table):
        console.print(block, soft_wrap=False)
