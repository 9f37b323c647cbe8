"""The repository stands alone: no tracked file points at the files it grew out of (a sibling
`shared` folder, its contract page). docs/design.md is the contract; cite its sections instead."""
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Spelled in pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "DESIGN" + ".md")


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist or an installed copy): nothing to list")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_tracked_file_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{lineno}: {word!r}: {line.strip()[:100]}"
                     for word in FORBIDDEN if word in line]
    assert not hits, "files that point outside the repository (cite docs/design.md §N instead):\n" + "\n".join(hits)


def test_no_raw_run_logs_are_tracked():
    """Measurement records live in docs/ as dated tables with their command (docs/benchmarks.md);
    raw logs stay out of the tree (git history keeps the old ones)."""
    logs = [str(p.relative_to(ROOT)) for p in tracked_files()
            if p.suffix == ".log" or "results" in p.relative_to(ROOT).parts]
    assert not logs, logs
