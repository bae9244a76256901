"""A table of rows that prints in a terminal and in Jupyter, with no pandas needed. Results and memory use it."""
from __future__ import annotations


class Table(list):
    """A list of row dicts that prints as a table in a terminal and in Jupyter (no pandas needed)."""

    @property
    def columns(self) -> list[str]:
        cols: list[str] = []
        for row in self:
            cols += [k for k in row if k not in cols]
        return cols

    def column(self, name: str) -> list:
        return [row.get(name) for row in self]

    def where(self, **equal) -> "Table":
        """Rows whose fields equal every given value, e.g. t.where(lab="lab03_ddp", world_size=2)."""
        return Table(r for r in self if all(r.get(k) == v for k, v in equal.items()))

    def select(self, *names: str) -> "Table":
        return Table({n: r.get(n) for n in names} for r in self)

    def wrapped(self) -> "Table":
        """The same table, its cells wrapping in a web page instead of scrolling sideways (for tables of prose)."""
        self.wrap = True
        return self

    def _cells(self):
        cols = self.columns
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
        return cols, [[fmt(r.get(c)) for c in cols] for r in self]

    def __str__(self) -> str:
        cols, rows = self._cells()
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
        line = lambda cells: "  ".join(s.ljust(w) for s, w in zip(cells, widths)).rstrip()
        return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])

    def _repr_html_(self) -> str:
        import html
        cols, rows = self._cells()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows)
        css = ' class="wrap"' if getattr(self, "wrap", False) else ""
        return f"<table{css}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        return str(self)
