"""Remake the README's tour from the current code: every ```console block's commands are run in
order (in a scratch folder, `memsched` as `python -m memsched`), the block's quoted output is
replaced by what they print now, and docs/report.png is a screenshot of the report the tour's
compile wrote (headless Chromium). The commands quoted are the commands run: nothing in the
tour is typed by hand, so it cannot drift from what memsched prints.

    python docs/make_tour.py [--no-picture]

Takes a few minutes (the tour's compile uses its full default time limit). The README is
rewritten atomically; a command that fails stops the script and leaves the README as it was.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PICTURE = ROOT / "docs" / "report.png"
BLOCK = re.compile(r"```console\n(.*?)```", re.S)
WINDOW = "1100,1250"


def commands_of(block: str) -> list[tuple[str, str, bool]]:
    """The commands of a console block: each as run (lines after '$ ', with '\\' continuations
    joined), as the README shows it (its lines kept), and whether the README shows its output
    (a command quoted without output stays so)."""
    commands: list[list] = []
    current = None
    for line in block.splitlines():
        if current is not None:
            current[1].append(line)
        elif line.startswith("$ "):
            current = [line[2:].strip(), [line]]
        else:
            if commands:
                commands[-1][2] = True
            continue
        if line.endswith("\\"):
            if len(current[1]) > 1:
                current[0] += " " + line.strip()
            current[0] = current[0][:-1].rstrip()
        else:
            if len(current[1]) > 1:
                current[0] += " " + line.strip()
            commands.append([current[0], "\n".join(current[1]), False])
            current = None
    return [(command, shown, printed) for command, shown, printed in commands]


def run(command: str, folder: Path) -> str:
    """One tour command as a user runs it; what it prints."""
    argv = shlex.split(command)
    if argv[0] != "memsched":
        raise SystemExit(f"the tour runs memsched commands only, not: {command}")
    done = subprocess.run([sys.executable, "-m", "memsched", *argv[1:]], cwd=folder, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "100"})
    if done.returncode != 0:
        raise SystemExit(f"`{command}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def screenshot(page: Path, picture: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no Chromium here for the report's picture; install it or pass --no-picture")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={WINDOW}", f"--screenshot={picture}",
                        page.as_uri()], check=True, capture_output=True, timeout=120)


def remake(text: str, folder: Path) -> str:
    """`text` with every console block's output made again, in order."""
    def block(match: re.Match) -> str:
        lines = []
        for command, shown, shows_output in commands_of(match.group(1)):
            printed = run(command, folder)
            lines.append(f"{shown}\n" + (printed if shows_output else ""))
        return "```console\n" + "".join(lines) + "```"
    return BLOCK.sub(block, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-picture", action="store_true", help="leave docs/report.png as it is")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memsched-tour-") as scratch:
        folder = Path(scratch)
        text = remake(README.read_text(), folder)
        reports = sorted(folder.rglob("*.html"))
        if not args.no_picture:
            if not reports:
                raise SystemExit("the tour wrote no report to picture")
            screenshot(reports[0], folder / "report.png")
            shutil.copyfile(folder / "report.png", PICTURE)
    partial = README.with_suffix(".md.partial")
    partial.write_text(text)
    partial.replace(README)
    print(f"remade {README.relative_to(ROOT)}" + ("" if args.no_picture else f" and {PICTURE.relative_to(ROOT)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
