#!/usr/bin/env bash
# The lint step (CI runs it before the tests): ruff at a pinned version over the Python, clang-format
# at a pinned version (.clang-format) over the C++/CUDA, and the repository's hygiene rules over the
# tracked files. Installs its pinned ruff and clang-format if they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
if ! python3 -m ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION"; then
  python3 -m pip install -q "ruff==$RUFF_VERSION"
fi
# Syntax errors and pyflakes (undefined names, unused imports and variables).
python3 -m ruff check --select E9,F .

# PyPI's clang-format wheel keeps its binary inside the package: found through it, whatever PATH says.
CLANG_FORMAT_VERSION=23.1.5
clang_format() { python3 -c 'import clang_format; print(clang_format.get_executable("clang-format"))' 2>/dev/null; }
if ! "$(clang_format)" --version 2>/dev/null | grep -qx "clang-format version $CLANG_FORMAT_VERSION"; then
  python3 -m pip install -q "clang-format==$CLANG_FORMAT_VERSION"
fi

fail=0
# The C++/CUDA as .clang-format lays it out (fix: the same binary with -i on the files it names).
if ! git ls-files -z '*.h' '*.cc' '*.cu' '*.cuh' | xargs -0 "$(clang_format)" --dry-run --Werror; then
  echo "lint: C++/CUDA files above are not as .clang-format lays them out (clang-format -i, version $CLANG_FORMAT_VERSION)" >&2
  fail=1
fi
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
