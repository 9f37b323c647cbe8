#!/usr/bin/env bash
# Prove that an isolated build (pip's default: the jaxlib pinned in pyproject.toml supplies the XLA
# FFI headers) has rlk_xla's CPU kernels and runs them under the oldest and the newest jax we test:
# build one wheel, install it into a fresh venv per jax version, run a strict-mode smoke test.
# Usage: bash scripts/check_install.sh [JAX_REQUIREMENT ...]   (default: jax==0.6.0 and the newest jax)
# RLK_WHEEL=dist/rlk_xla-...whl checks that wheel (scripts/build_wheel.sh) instead of building one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ "$#" -gt 0 ] || set -- "jax==0.6.0" jax

# CPU kernels only (the CUDA backend would add many minutes of nvcc and cannot run here); a build
# directory of its own, so that the tree's own build (scripts/setup.sh) is left as it is.
if [ -n "${RLK_WHEEL:-}" ]; then
  wheel=$(realpath "$RLK_WHEEL")
else
  RLK_CUDA=OFF "$PY" -m pip wheel -q --no-deps -w "$work/wheel" --config-settings=build-dir="$work/build" .
  wheel=$(echo "$work"/wheel/rlk_xla-*.whl)
fi

for jax in "$@"; do
  "$PY" -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "$wheel" "$jax"
  "$work/venv/bin/python" - <<'PY'
import jax, jax.numpy as jnp, jaxlib, numpy as np
import rlk_xla

n, h, v = 37, 64, 1000
k = jax.random.split(jax.random.PRNGKey(0), 3)
hidden = jax.random.normal(k[0], (n, h), jnp.float32)
weight = jax.random.normal(k[1], (v, h), jnp.float32) * h ** -0.5
targets = jax.random.randint(k[2], (n,), 0, v)

def loss(f, hidden, weight, **kw):
    return f(hidden, weight, targets, **kw).sum()

ref = jax.grad(loss, (1, 2))(rlk_xla.reference.linear_logp, hidden, weight)
for backward in ("fast", "lean"):
    fused = jax.grad(loss, (1, 2))(rlk_xla.linear_logp, hidden, weight, mode="strict", backward=backward)
    for a, b in zip(fused, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
logp = rlk_xla.linear_logp(hidden, weight, targets, mode="strict")
np.testing.assert_allclose(logp, rlk_xla.reference.linear_logp(hidden, weight, targets), rtol=1e-5, atol=1e-5)
cpu = rlk_xla.route_stats()["backends"]["cpu"]
assert cpu["fwd_calls"] == 3 and cpu["bwd_calls"] == 2 and cpu["bwd_fast_calls"] == 1, cpu
print(f"check_install: jax {jax.__version__}, jaxlib {jaxlib.__version__}: strict forward and gradients on the "
      f"CPU kernels match the reference ({cpu})")
PY
  rm -rf "$work/venv"
done
