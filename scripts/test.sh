#!/usr/bin/env bash
# Set up (scripts/setup.sh: venv, build) and run the test suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# The integrations are tested against the real packages (scripts/setup.sh installs only what rlk_xla needs).
pip install -q "transformers==5.24.0" "flax==0.12.8" "megatron-core==0.16.1" "trl==1.16.0"
python -m pytest -q tests "$@"
