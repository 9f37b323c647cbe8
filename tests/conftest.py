import os
import tempfile

# Eight CPU devices for the shard_map tests; must happen before jax creates its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# On a GPU machine JAX and torch tests share the device: no up-front 75% allocation by XLA.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# torch.compile's on-disk cache keys a compiled graph without our op's output sizes: a graph cached by
# another build (another kept-record layout) would be reused and fail its size asserts. Each test
# session starts from an empty cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="rlk-inductor-"))

try:
    import jax
except ImportError:  # a torch-only environment: the JAX tests skip themselves
    jax = None

if jax is not None:
    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except (AttributeError, KeyError):  # older jax: XLA_FLAGS above does it
        pass
