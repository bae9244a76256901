"""The any-machine rule for notebooks (CONTRIBUTING: "Outputs that every machine reproduces"): an output nbval does
not compare is checked by an assert in its cell; and dev.py's second CPU kernel path really does catch an output
that only reproduces on the kernels that wrote it."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "tools"))
from nbval_audit import IGNORE, audit, chapters  # noqa: E402  (book/tools/nbval_audit.py)


def _dev():
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_every_output_nbval_leaves_out_is_checked_by_an_assert(chapter):
    r = audit(chapter)
    assert not r["without_assert"], (f"{chapter.name}: cells {r['without_assert']} are tagged {IGNORE} but hold no "
                                     f"assert of what they show (CONTRIBUTING: outputs that every machine reproduces)")
    assert r["compared"] > 0


def test_the_audit_finds_an_excluded_cell_without_an_assert(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1.0 / 3)", metadata={"tags": [IGNORE]}),
                                         nbformat.v4.new_code_cell("x = 1\nassert x == 1", metadata={"tags": [IGNORE]}),
                                         nbformat.v4.new_code_cell("print(2)")])
    nbformat.write(nb, tmp_path / "01_x.ipynb")
    r = audit(tmp_path / "01_x.ipynb")
    assert r["without_assert"] == [0] and r["excluded_cells"] == 2


# A loss printed to all its digits: the cross-entropy of a batch of logits goes through torch's vectorised
# log-softmax (another ISA, other roundings) and a parallel reduction (another thread count, another order).
MACHINE_DEPENDENT = """import torch
g = torch.Generator().manual_seed(0)
logits, y = torch.randn(4096, 512, generator=g), torch.randint(0, 512, (4096,), generator=g)
print(repr(torch.nn.functional.cross_entropy(logits, y).item()), torch.randn(300_000, generator=g).sum().item())"""


@pytest.mark.timeout(300)
def test_the_second_kernel_path_fails_a_machine_dependent_output_and_passes_it_when_excluded(tmp_path):
    dev = _dev()
    first_env = {k: v for k, v in dev.os.environ.items() if k not in dev.KERNEL_VARS}
    first = dev.kernel_path(first_env, python=sys.executable)
    second_env = dev.second_pass_env(first, base=first_env)
    if second_env is None:
        pytest.skip(f"this CPU ({first['capability']}) has no second kernel path")
    # cell 1 compares the machine-dependent output, cell 2 shows the same one under the tag
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('text is compared everywhere')"),
                                         nbformat.v4.new_code_cell(MACHINE_DEPENDENT),
                                         nbformat.v4.new_code_cell(MACHINE_DEPENDENT + "\nassert logits.shape[0] == 4096",
                                                                   metadata={"tags": [IGNORE]})])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "machine.ipynb"
    nbformat.write(nb, path)
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    str(path)], env=first_env, check=True, capture_output=True, timeout=120)
    nbval = [sys.executable, "-m", "pytest", "--nbval", "-p", "no:cacheprovider", "-q", str(path)]
    same = subprocess.run(nbval, env=first_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert same.returncode == 0, same.stdout[-2000:]  # on the kernels that wrote it, every output reproduces
    other = subprocess.run(nbval, env=second_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # the compared loss differs on the second path (cell 1); the text (cell 0) and the excluded loss (cell 2) pass
    assert other.returncode != 0 and "1 failed, 2 passed" in other.stdout, other.stdout[-2000:]
    assert "::Cell 1" in other.stdout


def test_the_api_page_is_current_and_names_every_public_name():
    """book/api.md is generated from the docstrings (book/tools/make_api.py): it must be what they give now, and
    name every export of `import nanodist`, the Trainer, the CheckpointManager and every wrapper among them."""
    import nanodist
    import make_api  # noqa: E402  (book/tools/make_api.py)
    page = (ROOT / "book" / "api.md").read_text()
    assert page == make_api.render(), "book/api.md is out of date: run python book/tools/make_api.py"
    for name in nanodist.__all__:
        assert f"`nanodist.{name}" in page, name
    for name in ("Trainer", "CheckpointManager", "DDP", "FSDP", "DistAdamW", "ZeroOptimizer"):
        assert name in nanodist.__all__, name
    assert "api" in (ROOT / "book" / "_toc.yml").read_text()


def test_chapters_link_the_first_use_of_each_glossary_term():
    """book/tools/link_terms.py --check: chapters 3-6 link a glossary term where they first use it."""
    out = subprocess.run([sys.executable, str(ROOT / "book" / "tools" / "link_terms.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    glossary = (ROOT / "book" / "glossary.md").read_text()
    import link_terms  # noqa: E402  (book/tools/link_terms.py)
    for term in link_terms.EXACT + link_terms.PHRASES:
        assert f"\n{term}\n" in glossary, f"{term!r} is linked but not defined in book/glossary.md"
