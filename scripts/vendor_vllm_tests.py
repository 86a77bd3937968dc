"""Takes vLLM 0.34.0's own v1 core tests from its source distribution on PyPI into
`.vendor/vllm034-tests/` (git-ignored), for `tests/test_vllm_core_suite.py`, which runs them
with and without our `ResizableBlockPool` in place.

    python scripts/vendor_vllm_tests.py [--force]

The sdist (~50 MB) is checked against the sha256 PyPI lists for it; only the test files
below are kept (with the `__init__.py` files that make `tests.v1.core` importable). Nothing
happens when the files are there already and their stamp names this sdist. The index is
`$PIP_INDEX_URL` when set (a mirror of PyPI's simple API), else PyPI's.
"""

from __future__ import annotations

import hashlib
import html.parser
import io
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / ".vendor" / "vllm034-tests"
SDIST = "vllm-0.34.0.tar.gz"
SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
STAMP = TARGET / "SOURCE"
# Inside the sdist's `vllm-0.34.0/`: the core tests, and the one helper module they import.
KEEP_DIRS = ("tests/v1/core/",)
KEEP_FILES = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(value for name, value in attrs if name == "href" and value)


def sdist_url() -> str:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page_url = f"{index}/vllm/"
    with urllib.request.urlopen(page_url, timeout=120) as response:
        page = response.read().decode()
    links = _Links()
    links.feed(page)
    for href in links.hrefs:
        url = urllib.parse.urljoin(page_url, href)
        if urllib.parse.urlparse(url).path.endswith("/" + SDIST):
            return url.split("#", 1)[0]
    raise SystemExit(f"{page_url} lists no {SDIST}")


def download(url: str) -> bytes:
    log(f"vendor_vllm_tests: downloading {url}")
    with urllib.request.urlopen(url, timeout=600) as response:
        data: bytes = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{SDIST}: sha256 {digest}, expected {SHA256}: refusing it")
    return data


def kept(name: str) -> str | None:
    """The path inside the target for sdist member `name`, or None when it is not kept."""
    prefix = "vllm-0.34.0/"
    if not name.startswith(prefix):
        return None
    path = name[len(prefix) :]
    if path in KEEP_FILES or (path.startswith(KEEP_DIRS) and path.endswith(".py")):
        return path
    return None


def extract(data: bytes) -> int:
    staging = Path(tempfile.mkdtemp(prefix="vllm034-tests-", dir=TARGET.parent))
    count = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive.getmembers():
            path = kept(member.name)
            if path is None or not member.isfile():
                continue
            source = archive.extractfile(member)
            assert source is not None
            out = staging / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(source.read())
            count += 1
    (staging / "SOURCE").write_text(f"{SDIST} sha256 {SHA256}\n")
    if TARGET.exists():
        shutil.rmtree(TARGET)
    staging.rename(TARGET)
    return count


def main(argv: list[str]) -> int:
    force = "--force" in argv
    if not force and STAMP.exists() and SHA256 in STAMP.read_text():
        log(f"vendor_vllm_tests: {TARGET} holds {SDIST}'s tests already")
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    count = extract(download(sdist_url()))
    log(f"vendor_vllm_tests: {count} files of {SDIST} in {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
