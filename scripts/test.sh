#!/usr/bin/env bash
# Set up (scripts/setup.sh: venv, build) and run the test suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q tests "$@"
