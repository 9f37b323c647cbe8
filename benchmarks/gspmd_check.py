"""GSPMD under plain jax.jit on this host's devices (GPUs, or CPU devices with
XLA_FLAGS=--xla_force_host_platform_device_count=N): rlk_xla.linear_logp with a top-p nucleus over
a weight sharded over the vocab, no mesh set, against the shard_map path. Prints the compiled
program's all-gather count and whether the loss and the gradients are bitwise the shard_map path's.

    python benchmarks/gspmd_check.py --n 4096 --h 4096 --v 151936          # the GPU run (2, 4, 8 GPUs)
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python benchmarks/gspmd_check.py --n 64 --h 64 --v 1024             # the same on 4 CPU devices
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rlk_xla
from rlk_xla._compat import shard_map


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    args = ap.parse_args(argv)
    devs = jax.devices()
    tp = len(devs)
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs)
    k = jax.random.split(jax.random.key(0), 4)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))
    hidden = put(jax.random.normal(k[0], (args.n, args.h), jnp.bfloat16), P())
    weight = put((jax.random.normal(k[1], (args.v, args.h)) * args.h ** -0.5).astype(jnp.bfloat16), P("tp", None))
    targets = put(jax.random.randint(k[2], (args.n,), 0, args.v), P())
    keep = put(jax.random.uniform(k[3], (args.n, args.v)) < 0.3, P(None, "tp"))

    def grad_of(call):
        def loss(h, w):
            lp = call(h, w)
            return jnp.where(jnp.isfinite(lp), lp, 0).sum()
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    plain = grad_of(lambda h, w: rlk_xla.linear_logp(h, w, targets, keep_mask=keep, mode="strict"))
    per_shard = shard_map(lambda h, w, t, m: rlk_xla.linear_logp(h, w, t, keep_mask=m, axis_name="tp", backward="lean",
                                                                 mode="strict"),
                          mesh=mesh, in_specs=(P(), P("tp"), P(), P(None, "tp")), out_specs=P())
    sm = grad_of(lambda h, w: per_shard(h, w, targets, keep))
    hlo = plain.lower(hidden, weight).compile().as_text()
    (a, ga), (b, gb) = plain(hidden, weight), sm(hidden, weight)
    same = [bool(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))) for x, y in zip(ga, gb)]
    print(f"{tp} x {devs[0].device_kind}, {args.n} x {args.h} x {args.v}: all-gather ops "
          f"{hlo.count(' all-gather(') + hlo.count(' all-gather-start(')}, loss equal {bool(a == b)}, "
          f"dH equal {same[0]}, dW equal {same[1]}, dW {ga[1].sharding.spec}")


if __name__ == "__main__":
    main()
