"""Put the Colab set-up cell (book/tools/chapter_cells.py: colab_cell) first in every chapter, with the repository
address from pyproject.toml. Run it after changing that address; then re-execute the chapters.

    python book/tools/stamp_colab.py
"""
from pathlib import Path

import nbformat

from chapter_cells import stamp_colab

for path in sorted((Path(__file__).resolve().parents[1]).glob("[0-9][0-9]_*.ipynb")):
    nb = nbformat.read(path, 4)
    stamp_colab(nb)
    nbformat.write(nb, path)
    print(f"stamped {path.name}")
