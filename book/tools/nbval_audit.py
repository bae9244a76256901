"""Which outputs `pytest --nbval` compares digit by digit, and which it leaves out: the any-machine rule.

A cell whose output depends on the machine -- timings, and every floating-point result of training: losses, norms,
parameter hashes, memory traced from a run, anything computed in bf16 -- carries nbval's own tag
`nbval-ignore-output`. nbval still runs it (an exception fails the test) but does not compare what it shows, so the
cell must check what it shows itself: an `assert` of the invariant that matters, with its tolerance. Every other
output (text, structure, integers, booleans, byte counts from a formula) is compared exactly, on every machine.

    python3 book/tools/nbval_audit.py          # per chapter: outputs compared, outputs excluded

tests/test_book_rules.py runs `audit` over every chapter: an excluded cell without an `assert` fails it.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

IGNORE = "nbval-ignore-output"
BOOK = Path(__file__).resolve().parents[1]


def _has_assert(source: str) -> bool:
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]  # IPython magics
    return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse("\n".join(lines))))


def audit(path: Path) -> dict:
    """Count the outputs nbval compares and excludes in one notebook; list excluded cells that assert nothing."""
    nb = json.loads(Path(path).read_text())
    out = {"chapter": Path(path).stem, "compared": 0, "excluded": 0, "excluded_cells": 0, "without_assert": []}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        n = len(cell.get("outputs", []))
        if IGNORE in tags:
            out["excluded"] += n
            out["excluded_cells"] += 1
            if not _has_assert("".join(cell["source"])):
                out["without_assert"].append(i)
        else:
            out["compared"] += n
    return out


def chapters() -> list[Path]:
    return sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))


def main() -> None:
    rows = [audit(p) for p in chapters()]
    print(f"{'chapter':<16} {'outputs compared':>16} {'outputs excluded':>16} {'excluded cells':>14}")
    for r in rows:
        print(f"{r['chapter']:<16} {r['compared']:>16} {r['excluded']:>16} {r['excluded_cells']:>14}")
    bad = [(r["chapter"], r["without_assert"]) for r in rows if r["without_assert"]]
    if bad:
        sys.exit(f"excluded cells without an assert: {bad}")


if __name__ == "__main__":
    main()
