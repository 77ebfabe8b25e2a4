"""Shared fixtures: run the CLI as a user would, build tiny ONNX models."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `memsched ARGS` in a fresh process; returns the CompletedProcess (text mode)."""
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def cli():
    return run_cli
