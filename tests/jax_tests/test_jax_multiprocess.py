"""vocab_parallel_linear_logp across two JAX processes on the CPU (jax.distributed, gloo
collectives, 4 CPU devices each), the vocab axis spanning the process boundary: the bits of one
process with 8 devices.

The test starts this file as a script in two processes (`python test_jax_multiprocess.py
PROCESS_ID PORT OUT`), as a multi-host job starts one process per host; each writes what it got to
OUT. logp, entropy, dW and db must equal the single-process call bit for bit (the statistics are
summed with exact zeros, docs/design.md §3). dH and dT are sums of one partial per vocab shard,
whose order is the collective's own: gloo's and the in-process all-reduce may differ in the last
bits, so those are compared to the rounding of their dtype.
"""
import os
import sys

import numpy as np
import pytest

N, H, V, REAL = 96, 64, 1024, 1000      # global padded vocab 1024: 8 canonical chunks of 128
PROCESSES, LOCAL_DEVICES = 2, 4
MESHES = {"tp8": 1, "dp2_tp4": 2}        # name: dp (tp = 8 / dp)
GRADS = ("dh", "dw", "db", "dtemp")
TIMEOUT_S = 180
# dH (bf16, rounded once from its fp32 sum over the shards) may round the other way: one bf16 ulp;
# dT is fp32: a few fp32 ulps of its terms.
SUMMED_TOL = {"dh": (2.0 ** -7, 1e-6), "dtemp": (1e-5, 1e-6)}


def inputs():
    import ml_dtypes
    rng = np.random.default_rng(0)
    t = rng.integers(0, REAL, N)
    t[rng.random(N) < 0.1] = -100
    return dict(hidden=rng.standard_normal((N, H)).astype(ml_dtypes.bfloat16),
                weight=(rng.standard_normal((V, H)) * 3 / np.sqrt(H)).astype(ml_dtypes.bfloat16),
                bias=rng.standard_normal(V).astype(ml_dtypes.bfloat16),
                temperature=rng.uniform(0.5, 2.0, N).astype(np.float32),
                targets=t.astype(np.int32), g=rng.standard_normal(N).astype(np.float32),
                e=rng.standard_normal(N).astype(np.float32))


def mesh_of(devices, dp):
    """A dp x tp mesh of 8 devices, devices[:4] being process 0's and devices[4:] process 1's;
    every tp group takes devices of both processes."""
    from jax.sharding import Mesh
    d = np.array(devices, dtype=object).reshape(PROCESSES, dp, LOCAL_DEVICES // dp)  # [process, dp, k]
    return Mesh(d.transpose(1, 0, 2).reshape(dp, -1), ("dp", "tp"))


def run(devices):
    """{name: value} for every mesh: logp, entropy and the gradients of sum g logp + e entropy,
    on the host, whole."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import rlk_xla

    x = inputs()
    out = {}
    for name, dp in MESHES.items():
        mesh = mesh_of(devices, dp)
        tok = P("dp" if dp > 1 else None)
        specs = dict(hidden=tok, weight=P("tp"), bias=P("tp"), temperature=tok, targets=tok, g=tok, e=tok)
        a = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
             for k, v in x.items()}

        def loss(hidden, weight, bias, temperature, targets, g, e):
            lp, ent = rlk_xla.vocab_parallel_linear_logp(
                hidden, weight, targets, mesh=mesh, token_axis="dp" if dp > 1 else None, bias=bias,
                temperature=temperature, real_vocab_size=REAL, return_entropy=True, mode="strict")
            return jnp.sum(jnp.where(targets >= 0, lp, 0.0) * g) + jnp.sum(ent * e), (lp, ent)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                       out_shardings=NamedSharding(mesh, P()))  # everything whole on every process
        (_, (lp, ent)), grads = step(*(a[k] for k in ("hidden", "weight", "bias", "temperature", "targets", "g", "e")))
        for key, val in zip(("logp", "entropy") + GRADS, (lp, ent) + tuple(grads)):
            out[f"{name}/{key}"] = np.asarray(val.addressable_data(0)).astype(np.float32)
    return out


def worker(process_id: int, port: int, path: str) -> None:
    import jax
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=PROCESSES,
                               process_id=process_id, initialization_timeout=60)
    try:
        assert jax.process_count() == PROCESSES and len(jax.devices()) == PROCESSES * LOCAL_DEVICES
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        np.savez(path, **run(devices))
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    sys.exit(0)

pytest.importorskip("jax", reason="jax is not installed: this test needs it")

import jax  # noqa: E402

from subprocs import cpu_env, free_port, run_all  # noqa: E402


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jax2p")
    port, paths = free_port(), [tmp / f"process{i}.npz" for i in range(PROCESSES)]
    env = cpu_env(RLK_NUM_THREADS="1")
    failures = run_all([[os.path.abspath(__file__), str(i), str(port), str(paths[i])] for i in range(PROCESSES)],
                       [env] * PROCESSES, tmp, TIMEOUT_S)
    if failures:
        pytest.fail("the two JAX processes failed:\n" + "\n".join(failures), pytrace=False)
    return [dict(np.load(p)) for p in paths]


@pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 CPU devices for the one-process side (tests/conftest.py)")
def test_two_processes_give_the_bits_of_one(two_processes):
    one = run(jax.devices("cpu")[:8])
    for i, got in enumerate(two_processes):
        assert set(got) == set(one)
        for key, want in one.items():
            if key.split("/")[1] in SUMMED_TOL:
                rtol, atol = SUMMED_TOL[key.split("/")[1]]
                np.testing.assert_allclose(got[key], want, rtol=rtol, atol=atol, err_msg=f"process {i}: {key}")
            else:
                np.testing.assert_array_equal(got[key], want, err_msg=f"process {i}: {key}")
