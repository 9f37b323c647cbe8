"""Deprecated path (one release): use torch_bridge.integrations.rollout (the very same module)."""
import importlib
import sys
import warnings

warnings.warn("torch_bridge.rollout moved to torch_bridge.integrations.rollout; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("torch_bridge.integrations.rollout")
