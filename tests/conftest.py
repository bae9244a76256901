import os
import tempfile

import pytest

# Results written by the test suite never land in the repository: point the results directory at a
# temporary folder unless the caller (dev.py test) already did.
os.environ.setdefault("NANODIST_RESULTS_DIR", tempfile.mkdtemp(prefix="nanodist-test-results-"))
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """A fresh results directory for one test."""
    monkeypatch.setenv("NANODIST_RESULTS_DIR", str(tmp_path))
    return tmp_path


def pytest_terminal_summary(terminalreporter):
    """Under `dev.py test`: the time of each test module and each chapter, against the budgets in CONTRIBUTING
    (a chapter executes in <= 90 s, a test module runs in <= 2 min)."""
    if not os.environ.get("NANODIST_TIME_TABLE"):
        return
    from collections import defaultdict
    totals = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "nodeid", None) and isinstance(getattr(r, "duration", None), float):
                totals[r.nodeid.split("::")[0]] += r.duration
    terminalreporter.section("time per test module and chapter")
    for path, took in sorted(totals.items(), key=lambda kv: -kv[1]):
        budget = 90 if path.endswith(".ipynb") else 120
        terminalreporter.write_line(f"{took:7.1f} s  {path}" + (f"   over its {budget} s budget" if took > budget else ""))


def pytest_collection_modifyitems(items):
    """A notebook's cells are numerical tests too: dev.py's second kernel path (-m numerical) runs them again."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.numerical)
