#!/usr/bin/env bash
# Set up (scripts/setup.sh: venv, build) and run the test suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# The integrations are tested against the real packages (scripts/setup.sh installs only what rlk_xla needs).
pip install -q "transformers==5.24.0" "flax==0.12.8" "megatron-core==0.16.1" "trl==1.16.0"
# google-tunix 0.1.7 (the newest) pins safetensors<0.8, which transformers 5.24 (>=0.8) excludes: it goes in
# without its declared dependencies, plus the four that its RL modules and models import beyond ours.
pip install -q --no-deps "google-tunix==0.1.7"
pip install -q "google-metrax==0.2.4" "jaxtyping==0.3.11" "sentencepiece==0.2.3" "perfetto==0.59.1"
python -m pytest -q tests "$@"
