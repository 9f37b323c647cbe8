#!/usr/bin/env bash
# The lint step (CI runs it before the tests): ruff at a pinned version over the Python, and the
# repository's hygiene rules over the tracked files. Installs its pinned ruff if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
if ! python3 -m ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION"; then
  python3 -m pip install -q "ruff==$RUFF_VERSION"
fi
# Syntax errors and pyflakes (undefined names, unused imports and variables).
python3 -m ruff check --select E9,F .

fail=0
# The repository stands alone: no tracked file points at the files it grew out of (a sibling
# `shared` folder, its contract page); docs/design.md is the contract, cite its sections instead.
# Spelled in pieces so that this file does not match itself.
if git grep -n -F -e "../""shared" -e "DESIGN"".md" -- .; then
  echo "lint: files above point outside the repository (cite docs/design.md §N instead)" >&2
  fail=1
fi
# Measurement records live in docs/ as dated tables with their command (docs/benchmarks.md); raw
# logs stay out of the tree (git history keeps the old ones).
logs=$(git ls-files | grep -E '\.log$|(^|/)results/' || true)
if [ -n "$logs" ]; then
  printf 'lint: raw run logs are tracked:\n%s\n' "$logs" >&2
  fail=1
fi
exit $fail
