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
