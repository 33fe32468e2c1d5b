"""Every benchmark module imports: a rename elsewhere (edge_client.capture's QualityGate became FaceQuality) once
left `make bench-device` failing at its first line while no test imported it."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", BENCHES)
def test_the_benchmark_imports(name):
    importlib.import_module(f"bench.{name}")
