import importlib.util
import os
import pathlib
import tempfile

# scripts/test.sh --wheel: the suite tests the installed wheel, never this source tree.
if os.environ.get("RLK_TEST_INSTALLED") == "1":
    _root = pathlib.Path(__file__).resolve().parent.parent
    for _name in ("rlk_xla", "torch_bridge", "rlk_common", "_rlk_core"):
        _spec = importlib.util.find_spec(_name)
        _origin = _spec and pathlib.Path(_spec.origin).resolve()
        _home = _origin and (_origin.parent.parent if _origin.name == "__init__.py" else _origin.parent)
        assert _home is not None and _home != _root, (
            f"RLK_TEST_INSTALLED=1 but {_name} is imported from the source tree ({_origin})")

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
