"""Installed without torch (`pip install extensible-kv`, no `[torch]` extra): the core works, and
whatever needs torch says so once, naming the extra to install, instead of a raw
`ModuleNotFoundError` from deep inside.

Each case runs in a child process where importing torch fails as it does when torch is not
installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

EXTRA = "pip install '.[torch]' in a clone of extensible-kv"

NO_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_demo_help_works_without_torch() -> None:
    result = run_without_torch(
        """
        from extensible_kv.__main__ import main
        main(["demo", "--help"])
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--budget-mib" in result.stdout


def test_the_demo_says_which_extra_to_install() -> None:
    result = run_without_torch(
        """
        from extensible_kv.__main__ import main
        sys.exit(main(["demo", "--device", "cpu"]))
        """
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("demo: ") and EXTRA in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


CALLS = {
    "view": "ExtensibleTensor(1 << 20, granularity=4096).resize_(4096).view(None, (4,))",
    "full_view": "ExtensibleTensor(1 << 20, granularity=4096).full_view()",
    "segment_view": "ExtensibleTensor(1 << 20, granularity=4096).segment_view(0)",
    "kv_cache": "ExtensibleKVCache([KVCacheTensorSpec(64 << 10, {'a': LAYER})], 64)",
    "flow": "KVCacheFlow.reserve([KVCacheTensorSpec(64 << 10, {'a': LAYER})], 64, 'cpu')",
    "mamba": "gated_delta_net_state_spec()",
    "min_over_group": "min_over_group(1, None)",
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_what_needs_torch_names_the_extra(call: str) -> None:
    result = run_without_torch(
        f"""
        from extensible_kv import *
        t = ExtensibleTensor(1 << 20, granularity=4096)
        t.resize_(8192)  # the core needs no torch
        assert t.physical_bytes == 8192
        t.close()
        LAYER = AttentionLayerSpec("FLASH_ATTN", 16, num_kv_heads=8, head_size=128, dtype=None)
        try:
            {call}
        except ModuleNotFoundError as error:
            assert error.name == "torch", error.name
            print("raised:", error)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("raised:") and EXTRA in result.stdout, result.stdout
