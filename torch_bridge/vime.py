"""The public path of the vime provider: vime configs name `torch_bridge.vime.provider` by its dotted path.
This module is torch_bridge.integrations.vime itself (the very same module object)."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("torch_bridge.integrations.vime")
