"""The repository's promises about itself: one source of truth for dependencies, the two README commands."""
import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[1]


def normalise(req: str) -> str:
    return re.sub(r"\s+", "", req).lower().replace("_", "-")


def test_environment_yml_installs_exactly_the_pyproject_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(map(normalise, project["dependencies"]))
    for extra in project["optional-dependencies"].values():
        wanted |= set(map(normalise, extra))
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(d.startswith("python") for d in conda) and "pip" in conda
    assert "--editable ." in pip  # nanodist itself
    assert set(normalise(p) for p in pip if not p.startswith("-")) == wanted


def test_readme_quickstart_is_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^python3 dev\.py \w+", quick, re.M)
    assert commands == ["python3 dev.py book", "python3 dev.py test"]
    ci = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert ci[-1] == "exec python3 dev.py test"


def test_every_notebook_is_in_the_book():
    toc = yaml.safe_load((ROOT / "book" / "_toc.yml").read_text())
    files = {c["file"] for part in toc["parts"] for c in part["chapters"]} | {toc["root"]}
    pages = {p.stem for p in (ROOT / "book").glob("*.ipynb")} | {p.stem for p in (ROOT / "book").glob("*.md")}
    assert pages <= files, f"pages missing from book/_toc.yml: {pages - files}"
    assert files <= pages, f"book/_toc.yml lists pages that do not exist: {files - pages}"


def test_the_repository_address_is_written_in_one_place():
    """pyproject's [project.urls] Repository is the address; the book reads it at build time (no page types it) and
    the README, which GitHub shows as is, agrees with it."""
    import json
    import re
    import sys
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    from project_urls import TOKEN, repository_url
    url = repository_url()
    assert url.startswith("https://")
    readme_urls = set(re.findall(r"https://github\.com/[\w.-]+/[\w.-]+", (ROOT / "README.md").read_text()))
    assert readme_urls == {url}, readme_urls
    pages = list((ROOT / "book").glob("*.md")) + list((ROOT / "book").glob("*.ipynb"))
    assert any(TOKEN in p.read_text() for p in pages)
    sys.path.insert(0, str(ROOT / "book" / "tools"))
    from chapter_cells import COLAB_TAG, colab_cell
    for p in pages:
        text = p.read_text()
        if p.suffix == ".ipynb":  # Colab runs the notebook file itself: its set-up cell carries the stamped address
            cells = json.loads(text)["cells"]
            setup = [c for c in cells if COLAB_TAG in c.get("metadata", {}).get("tags", [])]
            first_code = next(c for c in cells if c["cell_type"] == "code")
            assert setup == [first_code], f"{p.name}: the Colab set-up cell must be the first code cell"
            assert "".join(setup[0]["source"]) == colab_cell().source, f"{p.name}: run book/tools/stamp_colab.py"
            text = json.dumps([c for c in cells if c is not setup[0]])
        assert url not in text, f"{p.name} types the repository address: write {TOKEN} instead"
