"""extensible-kv for vLLM 0.34: a drop-in `ExtensibleTensor` and the plugin that installs it.

`ExtensibleTensor` and `granule_size` have the API of `vllm.utils.extensible_tensor` (0.34.0)
over extensible-kv's core; `tensor`'s docstring lists what differs and why. `plugin.register`
is the `vllm.general_plugins` entry point. Nothing here imports vLLM.
"""

from extensible_kv.vllm.plugin import ENV_VAR, register, unregister
from extensible_kv.vllm.tensor import HANDLES_ENV_VAR, ExtensibleTensor, granule_size

__all__ = [
    "ENV_VAR",
    "HANDLES_ENV_VAR",
    "ExtensibleTensor",
    "granule_size",
    "register",
    "unregister",
]
