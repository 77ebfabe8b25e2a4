"""The README's tour: every command it quotes is one today's command line accepts, and the
script that remakes its outputs (docs/make_tour.py) reads its blocks as a user reads them."""
from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

from memsched.cli.options import attach_negative_values, build_parser

ROOT = Path(__file__).resolve().parent.parent


def make_tour():
    spec = importlib.util.spec_from_file_location("make_tour", ROOT / "docs" / "make_tour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOUR = make_tour()
COMMANDS = [command for block in TOUR.BLOCK.findall((ROOT / "README.md").read_text())
            for command, _, _ in TOUR.commands_of(block)]


def test_the_tour_quotes_commands_with_and_without_their_output():
    blocks = TOUR.BLOCK.findall("```console\n$ memsched a \\\n    --b 1\n$ memsched c\nline\n```")
    assert TOUR.commands_of(blocks[0]) == [("memsched a --b 1", "$ memsched a \\\n    --b 1", False),
                                           ("memsched c", "$ memsched c", True)]
    assert len(COMMANDS) >= 5 and all(c.startswith("memsched ") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_quoted_command_is_accepted_by_the_command_line(command):
    args = build_parser().parse_args(attach_negative_values(shlex.split(command)[1:]))
    assert callable(args.handler)
