"""A process that builds a torch face model reuses the memory torch frees instead of faulting it in again.

Counted in page faults (`getrusage`), not seconds, so a loaded machine cannot fail it. Each case runs in a fresh
interpreter: the switch is process-wide, and this test process has built models already.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from models.cpu_memory import OFF_ENV

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the switch is glibc's malloc's (elsewhere reuse_freed_memory is a no-op)")

BLOCK_PAGES = 64 * 2 ** 20 // 4096  # one 64 MiB block, as large as a batch's activations

LOOP = """
import json, resource, sys, torch
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.empty(16 * 2 ** 20).fill_(1.0); del x  # the first time the pages must come from the kernel anyway
before = faults()
for _ in range(10):
    x = torch.empty(16 * 2 ** 20).fill_(1.0)
    del x
print(json.dumps({{"faults": faults() - before}}))
"""


def _huge_pages_always() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.exists() and "[always]" in thp.read_text()


countable_faults = pytest.mark.skipif(
    _huge_pages_always(), reason="transparent huge pages are always on here: a fresh block faults in 2 MiB pages, "
                                 "too few to count")


def _faults_over_ten_blocks(setup: str, **extra_env: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != OFF_ENV}  # the switch as shipped, whatever this shell says
    env.update(extra_env)
    run = subprocess.run([sys.executable, "-c", LOOP.format(setup=setup)], capture_output=True, text=True,
                         timeout=300, check=True, env=env)
    return json.loads(run.stdout.strip().splitlines()[-1])["faults"]


@countable_faults
def test_building_a_face_embedder_stops_torch_faulting_its_freed_blocks_in_again():
    default = _faults_over_ten_blocks("")
    with_model = _faults_over_ten_blocks("from models.networks.backbone import FaceEmbedder\n"
                                         "FaceEmbedder(128, pretrained=False)")
    assert default > 5 * BLOCK_PAGES, f"glibc's default no longer returns large blocks ({default} faults)"
    assert with_model < BLOCK_PAGES, f"{with_model} page faults over ten 64 MiB blocks after the model was built"


def test_the_switch_is_taken_once_and_says_whether_it_took(monkeypatch):
    from models.cpu_memory import reuse_freed_memory

    monkeypatch.delenv(OFF_ENV, raising=False)
    reuse_freed_memory.cache_clear()
    assert reuse_freed_memory() is True
    assert reuse_freed_memory() is True  # a second call (cached) answers the same


@countable_faults
def test_a_device_that_must_give_memory_back_can_leave_glibcs_defaults():
    left = _faults_over_ten_blocks("from models.networks.backbone import FaceEmbedder\n"
                                   "FaceEmbedder(128, pretrained=False)", **{OFF_ENV: "0"})
    assert left > 5 * BLOCK_PAGES, f"only {left} page faults: the switch was taken although {OFF_ENV}=0"
