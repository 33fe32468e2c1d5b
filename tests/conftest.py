"""Shared fixtures: synthetic datasets the tests make, the real faces in ../shared/faces, one trained run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Crops cached by tests go to a temporary folder, never to the user's cache."""
    os.environ["FFR_CACHE_DIR"] = str(tmp_path_factory.mktemp("ffr-cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def faces_dir() -> Path:
    """The real face sets (../shared/faces, or $FFR_FACES_DIR)."""
    path = Path(os.environ.get("FFR_FACES_DIR", REPO.parent / "shared" / "faces"))
    if not (path / "orl").is_dir():
        pytest.skip(f"real face data not found at {path} (set FFR_FACES_DIR)")
    return path


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    from models.faces.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("synthetic") / "faces", n_identities=10, n_images=6, seed=3)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, synthetic_dir) -> Path:
    """A real (tiny) `ffr train` run with the DFC branch: 3 epochs on 10 synthetic identities."""
    from models.cli import main

    out = tmp_path_factory.mktemp("runs") / "run"
    rc = main(["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "3", "--lr", "1e-3",
               "--dfc", "--holdout-identities", "0.3", "--no-mlflow", "--batch-size", "16"])
    assert rc == 0
    return out
