"""torch is optional: the core (`ExtensibleTensor`'s reserve, grow, shrink, DLPack views) needs
none, so `pip install extensible-kv` does not pull in a multi-GB wheel that a serving stack
brings in its own build of. Whatever does need it (views, the KV cache, the flow, the demo)
calls `require` first, so a missing torch is one error naming the extra, not a raw
`ModuleNotFoundError` from deep inside."""

from __future__ import annotations

import sys

__all__ = ["INSTALL_HINT", "require"]

INSTALL_HINT = "pip install '.[torch]'"


def require(feature: str) -> None:
    """Raises `ModuleNotFoundError` (name `torch`) saying that `feature` needs torch and how to
    install it, when torch cannot be imported."""
    if sys.modules.get("torch") is not None:
        return  # the common case: one dict lookup
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise  # torch is there but broken: its own error says more
        raise ModuleNotFoundError(
            f"{feature} needs torch, which is not installed: {INSTALL_HINT} in a clone of "
            "extensible-kv (no package index has it yet), or install the torch build for your "
            "CUDA version (https://pytorch.org)",
            name="torch",
        ) from None
