"""Deprecated path (one release): use torch_bridge.integrations.megatron (the very same module)."""
import importlib
import sys
import warnings

warnings.warn("torch_bridge.megatron moved to torch_bridge.integrations.megatron; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("torch_bridge.integrations.megatron")
