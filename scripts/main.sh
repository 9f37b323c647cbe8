#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job on this machine's default device (the GPU when
# there is one, else the CPU): a self-check of the installed build and a small benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m rlk_xla check
python -m rlk_xla bench --shape small
