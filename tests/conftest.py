import os

# Eight CPU devices for the shard_map tests; must happen before jax creates its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, KeyError):  # older jax: XLA_FLAGS above does it
    pass
