"""Shared fixtures: run the CLI as a user would, build tiny ONNX models."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `memsched ARGS` in a fresh process; returns the CompletedProcess (text mode)."""
    return subprocess.run([sys.executable, "-m", "memsched", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


# Property tests draw the same examples on every run (a seed derived from each test) and have
# no per-example deadline: the suite gives one answer on a loaded machine too.
settings.register_profile("memsched", derandomize=True, deadline=None)
settings.load_profile("memsched")


@pytest.fixture
def cli():
    return run_cli
