"""What the chapter generators (make_05.py, make_06.py, ...) share: cell builders and the exercise pattern.

An exercise is four cells: the question (markdown), a hidden cell registering the expected value (tag remove-cell:
never on the page), the reader's cell with a hint-only check, and a collapsed solution (tag hide-input).
"""
from pathlib import Path

import nbformat as nbf

HIDDEN = {"tags": ["remove-cell"], "jupyter": {"source_hidden": True}}      # the expected answer: not on the page
SOLUTION = {"tags": ["hide-input"], "jupyter": {"source_hidden": True}}     # the solution: collapsed until opened
TIMING = {"tags": ["nbval-ignore-output"]}                                 # hardware- and timing-dependent output


class Chapter:
    def __init__(self):
        self.cells = []

    def md(self, text):
        self.cells.append(nbf.v4.new_markdown_cell(text.strip("\n")))

    def code(self, text, meta=None):
        c = nbf.v4.new_code_cell(text.strip("\n"))
        if meta:
            c.metadata.update(meta)
        self.cells.append(c)

    def exercise(self, key, question, expected, answer_cell, hint, solution):
        self.md(f"**{key[2:]}.** {question}")
        self.code(f"expect({key!r}, {expected})", HIDDEN)
        self.code(f"{answer_cell}\ncheck(answer, exercise={key!r},\n      hint={hint!r})")
        self.code(f"{solution}\ncheck(answer, exercise={key!r}, hint='')", SOLUTION)

    def write(self, name: str) -> Path:
        nb = nbf.v4.new_notebook(cells=self.cells)
        nb.metadata.update({"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                            "language_info": {"name": "python"}})
        out = Path(__file__).resolve().parents[1] / name
        nbf.write(nb, out)
        print(f"wrote {out}")
        return out
