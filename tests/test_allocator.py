"""care.allocator.keep_freed_memory: a process that frees and re-allocates a large block stops page-faulting it
in again (the cost it removes from every training step, docs/training.md "CPU memory").  Each case runs in
its own process: the setting is process-wide."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

ROUNDS, BLOCK_MB = 10, 64
PAGES_PER_BLOCK = BLOCK_MB * 2**20 // 4096

PROBE = f"""
import json, resource, sys
import torch
from care.allocator import keep_freed_memory
applied = keep_freed_memory()
for _ in range({ROUNDS}):     # warm-up: the heap grows until a freed block fits the next (aligned) request
    torch.ones({BLOCK_MB} * 2**20 // 4).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    block = torch.ones({BLOCK_MB} * 2**20 // 4)              # a fresh 64 MB block, every page written
    block.sum()
    del block
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({{"applied": applied, "faults": after - before}}))
"""


def probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default = probe(CARE_KEEP_FREED_MEMORY="0")
    kept = probe(CARE_KEEP_FREED_MEMORY="1")
    assert default["applied"] is False and kept["applied"] is True
    # glibc's default: each 64 MB block is a new mmap, every page faulted again
    assert default["faults"] >= 0.9 * ROUNDS * PAGES_PER_BLOCK, default
    # kept: the heap holds freed blocks and hands them back (a round may still grow it once or twice)
    assert kept["faults"] < 0.3 * ROUNDS * PAGES_PER_BLOCK, kept


def applied(**env) -> bool:
    code = "from care.allocator import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.strip() == "True"


def test_a_preloaded_allocator_is_left_alone():
    assert applied(LD_PRELOAD="", CARE_KEEP_FREED_MEMORY="1")
    # the name alone decides (the library need not exist here: the loader warns and goes on)
    assert not applied(LD_PRELOAD="libjemalloc.so.2", CARE_KEEP_FREED_MEMORY="1")
