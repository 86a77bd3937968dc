"""What `pip install` ships: the native module without debug info (maturin builds every wheel,
and the editable install, from the same settings), and metadata that shows the README."""

from __future__ import annotations

import struct
from importlib import metadata
from pathlib import Path

from extensible_kv import _native

ROOT = Path(__file__).resolve().parent.parent


def elf_section_names(path: str) -> list[str]:
    """The section names of a 64-bit little-endian ELF file (the header layout of `elf(5)`)."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not ELF64 LE"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    names = []
    for name_index, *_ in headers:
        start = names_offset + name_index
        names.append(data[start : data.index(b"\0", start)].decode())
    return names


def test_the_native_module_ships_without_debug_info() -> None:
    names = elf_section_names(_native.__file__)
    assert ".text" in names and ".dynsym" in names  # the parser read real sections
    debug = [name for name in names if name.startswith(".debug")]
    assert not debug, debug
    size = Path(_native.__file__).stat().st_size
    assert size < 4 << 20, f"{size} bytes"


def test_metadata_carries_the_readme() -> None:
    meta = metadata.metadata("extensible-kv")
    readme = (ROOT / "README.md").read_text()
    assert meta["Description-Content-Type"].startswith("text/markdown")
    description = meta.get_payload() or meta["Description"]  # type: ignore[attr-defined]
    assert isinstance(description, str)
    assert readme.splitlines()[0] in description and "## What it guarantees" in description


def test_the_license_file_matches_the_metadata_and_the_cli_tells_its_version() -> None:
    import subprocess
    import sys

    import extensible_kv

    assert metadata.metadata("extensible-kv")["License"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    out = subprocess.run(
        [sys.executable, "-m", "extensible_kv", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"extensible-kv {extensible_kv.__version__}"
