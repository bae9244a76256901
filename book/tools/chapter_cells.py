"""What the chapter generators (make_05.py, make_06.py, ...) share: cell builders and the exercise pattern.

An exercise is four cells: the question (markdown), a hidden cell registering the expected value (tag remove-cell:
never on the page), the reader's cell with a hint-only check, and a collapsed solution (tag hide-input). A
predict-then-run exercise (Chapter.predict) has the reader's prediction, the run that measures and compares, and
the collapsed solution.
"""
from pathlib import Path

import nbformat as nbf

# Hidden three ways: the web page (the tags), JupyterLab (source_hidden) and Colab, which reads neither: a cell whose
# first line is a `#@title` and whose metadata says cellView "form" shows there as its title, its code folded.
HIDDEN = {"tags": ["remove-cell"], "jupyter": {"source_hidden": True}, "cellView": "form"}  # the expected answer
SOLUTION = {"tags": ["hide-input"], "jupyter": {"source_hidden": True}, "cellView": "form"}  # collapsed until opened
HIDDEN_TITLE = "#@title Expected answer (hidden)"
SOLUTION_TITLE = "#@title Solution"
MACHINE = {"tags": ["nbval-ignore-output"]}  # depends on the machine: timing, or floating-point results of training;
# such a cell must hold an assert of what it shows (CONTRIBUTING: "Outputs that every machine reproduces")


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
        self.code(f"{HIDDEN_TITLE}\nexpect({key!r}, {expected})", HIDDEN)
        self.code(f"{answer_cell}\ncheck(answer, exercise={key!r},\n      hint={hint!r})")
        self.code(f"{SOLUTION_TITLE}\n{solution}\ncheck(answer, exercise={key!r}, hint='')", SOLUTION)

    def predict(self, key, question, blank, run, hint, solution, rel_tol=None, measured_by=None):
        """A predict-then-run exercise (nanodist.exercises.compare): the question, the reader's prediction cell,
        the run that measures the answer on the reader's machine and compares, and a collapsed solution that
        explains the prediction and compares it too. The run cell leaves the measurement in `measured`.
        rel_tol and measured_by go to compare (a tolerance; "the projection gives" for a model's number)."""
        extra = "".join(f", {k}={v!r}" for k, v in (("rel_tol", rel_tol), ("measured_by", measured_by)) if v is not None)
        self.md(f"**{key[2:]}.** *Predict, then run.* {question}")
        self.code(blank)
        self.code(f"{run}\ncompare(prediction, measured, exercise={key!r}{extra},\n        hint={hint!r})")
        # reveal=False: a folded cell's output stays on the page, so the solution's says only "Right!"
        self.code(f"{SOLUTION_TITLE}\n{solution}\n"
                  f"compare(prediction, measured, exercise={key!r}{extra}, hint='', reveal=False)", SOLUTION)

    def write(self, name: str) -> Path:
        nb = nbf.v4.new_notebook(cells=self.cells)
        stamp_colab(nb)
        nb.metadata.update({"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                            "language_info": {"name": "python"}})
        out = Path(__file__).resolve().parents[1] / name
        nbf.write(nb, out)
        print(f"wrote {out}")
        return out


COLAB_TAG = "colab-setup"


def repository_url() -> str:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_ext"))
    from project_urls import repository_url as url
    return url()


def colab_cell():
    """Every chapter's first code cell: on Colab, fetch nanodist and the one package Colab lacks (myst-nb, for
    glue), keeping Colab's own torch; anywhere else it does nothing. The address is stamped from pyproject.toml
    (book/tools/stamp_colab.py; tests/test_packaging.py checks it); the web page does not show the cell."""
    c = nbf.v4.new_code_cell(f'''# On Colab: fetch nanodist and what Colab lacks (its own torch stays). Anywhere else this does nothing.
import importlib.util
import os
import subprocess
import sys

if "google.colab" in sys.modules and importlib.util.find_spec("nanodist") is None:
    subprocess.run(["git", "clone", "-q", "--depth", "1", "{repository_url()}", "/content/nanodist"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "/content/nanodist", "myst-nb"], check=True)
    sys.path.insert(0, "/content/nanodist")
    os.chdir("/content/nanodist/book")''')
    c.metadata["tags"] = [COLAB_TAG, "remove-cell"]
    return c


def stamp_colab(nb) -> None:
    """Put colab_cell() first among the notebook's code cells (replacing an older one)."""
    nb.cells = [c for c in nb.cells if COLAB_TAG not in c.get("metadata", {}).get("tags", [])]
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(first_code, colab_cell())
