"""The docs stay true (issues 23 and 35): every repository path, Python name and Rust item that
README.md, docs/design.md and docs/benchmarks.md name in backticks exists, and exists where the
doc places it; a block introduced as verbatim equals its source; and the lists the code can
make itself (the modules that allow `unsafe`, the environment variables, the `Driver` trait's
methods) match the code.

How a backticked token is read (in text, not in fenced code blocks, which other tests run):

- **paths**: a token with a `/` that starts at a top-level entry of the repository, or a bare
  file name ending in a source extension (`.rs`, `.py`, `.pyi`, `.md`, `.toml`, `.sh`), must
  exist (`path:line` and `path §N` are cut to the path; globs and `{a,b}` expand; a bare
  name or partial path must be the tail of some file). URLs, paths outside the repository
  (`/proc/…`, `../…`), and git-ignored build outputs (`.venv`, `.vendor/…`) are skipped.
  A token with spaces is a command or an expression: only its first word is checked, when
  that word is a repository path.
- **Python**: `extensible_kv.a.b` (or `extensible_kv.a:b`, an entry point) must resolve to a
  module of `python/` and then to names bound in it (read with `ast`, nothing imported).
  `Name.attr` where `Name` is one of our classes or modules must name a member of it.
- **Rust**: `a::b::C` must name items of `src/` (and `C` must live where `a` says when `a` is
  a module or a type of ours).
- **identifiers**: any other bare name or call (`Name`, `name(...)`, `name=`, `Name { .. }`,
  `Name<T>`) must be defined somewhere in our code (a Python def, class, parameter,
  attribute, or string constant; a Rust fn, type, variant, field, const or module; a file
  or directory name), be a builtin (Python's builtins, errno, mmap, fcntl and socket
  constants), or be on the commented allow-list below: names that belong to vLLM, SGLang,
  transformers, torch, CUDA or Linux, which this repository cannot check.
- **environment variables** (`EKV_*`, `EXTENSIBLE_KV_*`) must be read by the code.

Where a name is placed (`Claim`): a table with a `files` or `where` column places each
unqualified name of a row's last column under that row's path; a sentence places one with
`X` in `P`, `X` = value in `P`, `X` (`P`), `P` (.. `X` ..) or `P`: .. `X` ..; where the name
is ours (some file defines it), one of `P`'s files must define it: a Rust item, field or
variant, or a Python function, class, parameter or assignment target (an import is no home).

Every failure is printed as `FILE:LINE: \\`token\\`: why`.
"""

from __future__ import annotations

import ast
import builtins
import errno
import fcntl
import functools
import keyword
import mmap
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/design.md", "docs/benchmarks.md")

# Source extensions: a bare token ending in one of them names a file of ours.
EXTENSIONS = (".rs", ".py", ".pyi", ".md", ".toml", ".sh")
# Build outputs and caches: never part of the checked tree, skipped when named.
IGNORED_DIRS = {
    ".git",
    "target",
    ".venv",
    ".vendor",
    "dist",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
}
# Paths the docs name that are deliberately outside the checked tree (git-ignored, made by
# scripts): `.venv` by scripts/setup, `.vendor/` by scripts/vendor-*.
GENERATED_PREFIXES = (".venv", ".vendor")

# Names this repository cannot check, by owner. Add a name here only when it is not ours.
FOREIGN = {
    # vLLM 0.34 (its modules, classes, functions, parameters and settings)
    "vllm": """ExtensibleKVCache.__init__ KVCacheTensor UnspecifiedPlatform extensible_kv_cache
        step_fn extensible_tensor.py gpu_worker gpu_worker.py vmm_driver.py granule_size
        gpu_memory_utilization kv_cache_lent_for_weight_update min_committed_blocks
        pad_kv_cache_segments registers_kv_cache_memory recommit get_kv_cache_shape
        get_kv_cache_stride_order segments_backed_by_one_chunk resize_segments_ tvm_ffi
        commit vllm/utils/extensible_tensor.py vllm/v1/worker/extensible_kv_cache.py
        BlockPool.__init__ free_block_queue num_gpu_blocks collective_rpc extend_kv_cache
        create_kv_cache_views""",
    # SGLang 0.5.x
    "sglang": """HookRegistry KvVmmArena MHATokenToKVPool._create_buffers finalize_backing
        release_memory_occupation resume_memory_occupation load_inline TokenToKVPoolAllocator
        free_pages alloc""",
    # transformers 5.x
    "transformers": """ContinuousBatchingConfig PagedAttentionCache StaticCache generate_batch
        init_continuous_batching continuous_batching_context_manager continuous_api
        max_memory_percent manager.pause num_blocks sdpa eager BlockLedger copy_blocks
        can_store_request_tokens CachePool""",
    # torch, DLPack's protocol, Python's stdlib tools
    "torch": """from_dlpack untyped_storage mem_get_info empty_cache max_version byte_offset
        set_per_process_memory_fraction faulthandler wrapt.when_imported mypy.stubtest
        sys.path .pth""",
    # Rust's std and language
    "rust": """Arc Vec BTreeMap Mutex Clone Send Sync u64 debug_assert_eq! pub fn unsafe fn
        unsafe unsafe_code Inner::drop""",
    # Linux and libc (syscalls, /proc fields, capabilities, sysctls)
    "linux": """fallocate mprotect munmap memcpy MemAvailable CAP_SYS_PTRACE ptrace_scope
        memory.max memory.current write(2) SCM_CREDENTIALS NOT_PERMITTED NOT_SUPPORTED
        pidfd_open pidfd_getfd sigaction PROT_NONE MAP_FIXED MAP_SHARED MAP_NORESERVE""",
    # PyO3
    "pyo3": """py.detach""",
    # CUDA's driver API (also matched by the patterns below)
    "cuda": """gpuDirectRDMACapable requestedHandleTypes compute-sanitizer""",
    # cudarc (the crate and its features)
    "cudarc": """driver::sys dynamic-loading cuda-13000 result sys""",
}
FOREIGN_NAMES = {name for names in FOREIGN.values() for name in names.split()}
# CUDA driver API calls, types and error codes: `cuMemCreate`, `CUstream`, `CUDA_ERROR_…`.
FOREIGN_PATTERNS = (re.compile(r"^(cu[A-Z]\w*|CU[a-z]\w*|CUDA_\w+|CU_\w+)$"),)
# Modules of other projects: a dotted token starting with one of them is theirs.
FOREIGN_MODULES = ("vllm", "sglang", "transformers", "torch", "triton", "numpy")
# Aliases the docs' examples bind.
ALIASES = {"ekt": "extensible_kv.transformers"}
# Trait methods Rust derives or std provides: `GrowOptions::default()`.
STD_METHODS = {"default", "clone", "drop", "from", "fmt", "eq"}
ENV_NAME = re.compile(r"^(EKV|EXTENSIBLE_KV)_[A-Z0-9_]+$")


@dataclass(frozen=True)
class Token:
    file: str
    line: int
    text: str

    def fail(self, why: str) -> str:
        return f"{self.file}:{self.line}: `{self.text}`: {why}"


def prose(name: str) -> str:
    """A doc with its fenced blocks blanked out, newlines kept so line numbers stay right."""
    text = (ROOT / name).read_text()
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def doc_tokens(name: str) -> list[Token]:
    """The inline code spans of a doc, outside fenced blocks, with their line numbers."""
    text = prose(name)
    return [
        Token(name, text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text)
    ]


# ---------------------------------------------------------------------------------------------
# what the repository holds


@functools.cache
def repo_files() -> tuple[str, ...]:
    """Every file of the tree (relative, `/`-separated), build outputs left out."""
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in IGNORED_DIRS]
        rel = Path(top).relative_to(ROOT)
        found += [(rel / f).as_posix() for f in files]
    return tuple(sorted(found))


@functools.cache
def repo_dirs() -> frozenset[str]:
    return frozenset(str(Path(f).parent.as_posix()) for f in repo_files()) | {
        "/".join(Path(f).parts[:i]) for f in repo_files() for i in range(1, len(Path(f).parts))
    }


def _sources(*tops: str, ext: str) -> list[Path]:
    """The files under these top-level directories with this extension; not this file, whose
    lists and examples name what the docs must not."""
    return [
        ROOT / f
        for f in repo_files()
        if f.split("/")[0] in tops and f.endswith(ext) and f != "tests/test_docs.py"
    ]


@dataclass
class PyModule:
    """Names a Python module binds at top level, its classes' members, and its imports."""

    names: set[str]
    classes: dict[str, set[str]]
    bases: dict[str, list[str]]
    imported: dict[str, str]  # local name -> "module.name"


@functools.cache
def python_modules() -> dict[str, PyModule]:
    """`extensible_kv…` module name -> what it binds (from `python/`, stubs included)."""
    modules = {}
    for path in _sources("python", ext=".py") + _sources("python", ext=".pyi"):
        rel = path.relative_to(ROOT / "python").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        name = ".".join(parts)
        tree = ast.parse(path.read_text())
        module = modules.setdefault(name, PyModule(set(), {}, {}, {}))
        for node in tree.body:
            module.names |= _bound_names(node)
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = _class_members(node)
                module.bases[node.name] = [ast.unparse(b).split("[")[0] for b in node.bases]
            if isinstance(node, ast.ImportFrom) and node.module:
                source = _absolute(node.module, node.level, name, path.name == "__init__.py")
                for alias in node.names:
                    module.imported[alias.asname or alias.name] = f"{source}.{alias.name}"
    return modules


def _absolute(module: str, level: int, here: str, is_package: bool) -> str:
    if not level:
        return module
    base = here.split(".")
    base = base if is_package else base[:-1]
    return ".".join([*base[: len(base) - level + 1], module])


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.If | ast.Try):
        inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
        inner += [s for h in getattr(node, "handlers", []) for s in h.body]
        return {n for s in inner for n in _bound_names(s)}
    return set()


def _class_members(node: ast.ClassDef) -> set[str]:
    members = {n for s in node.body for n in _bound_names(s)}
    for sub in ast.walk(node):  # self.x = ... in any method
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            members.add(sub.attr)
    return members


@functools.cache
def python_index() -> frozenset[str]:
    """Every name our Python defines or spells: defs, classes, parameters, attributes,
    assignment targets, keyword arguments and identifier-like string constants."""
    names: set[str] = set()
    paths = _sources("python", "tests", "benchmarks", "scripts", ext=".py")
    for path in [*paths, *_sources("python", ext=".pyi")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"[A-Za-z_][\w.]*", node.value):
                    names.update({node.value, *node.value.split(".")})
    return frozenset(names)


RUST_ITEM = re.compile(
    r"\b(?:fn|struct|enum|trait|type|mod|const|static|union)\s+([A-Za-z_]\w*)"
    r"|macro_rules!\s*([A-Za-z_]\w*)"
    r"|^\s*(?:pub(?:\([^)]*\))?\s+)?([a-z_]\w*)\s*:\s*(?!:)"  # struct fields
    r"|^\s*([A-Z]\w*)\s*(?:[,({=]|$)",  # enum variants
    re.M,
)


@functools.cache
def rust_items() -> dict[str, frozenset[str]]:
    """Rust file (relative) -> the items, fields and variants it defines."""
    items = {}
    for path in _sources("src", "tests", "benches", ext=".rs"):
        code = re.sub(r"//.*", "", path.read_text())
        # An import defines nothing here: `pub use options::{.., DEFAULT_MAX_HANDLE_BYTES};`
        code = re.sub(r"^\s*(?:pub(?:\([^)]*\))?\s+)?use\s[^;]*;", "", code, flags=re.M)
        found = {next(g for g in m.groups() if g) for m in RUST_ITEM.finditer(code)}
        items[path.relative_to(ROOT).as_posix()] = frozenset(found)
    return items


@functools.cache
def rust_source(rel: str) -> str:
    return (ROOT / rel).read_text()


@functools.cache
def rust_index() -> frozenset[str]:
    return frozenset(n for names in rust_items().values() for n in names)


@functools.cache
def file_names() -> frozenset[str]:
    """File names, their stems, and directory names: `books`, `stray.rs`, `cuda`."""
    names = set()
    for f in repo_files():
        parts = f.split("/")
        names.update(parts)
        names.add(Path(f).stem)
    return frozenset(names)


def _rust_module_files(module: str) -> list[str]:
    """The files of a Rust module named by its last path part: `plan`, `vmm`, `tensor`."""
    return [
        f
        for f in rust_items()
        if f.startswith("src/")
        and (Path(f).stem == module or (f"/{module}/" in f"/{f}" and not f.endswith("lib.rs")))
    ]


def _rust_type_files(name: str) -> list[str]:
    """The files that define or implement a Rust type or trait."""
    pattern = re.compile(
        rf"\b(?:struct|enum|trait|type)\s+{name}\b|\bimpl\b[^{{;]*\b{name}\b\s*(?:<[^{{]*>)?\s*\{{"
    )
    return [f for f in rust_items() if pattern.search(rust_source(f))]


# ---------------------------------------------------------------------------------------------
# environment variables the code reads


@functools.cache
def env_reads() -> dict[str, set[str]]:
    """`EKV_*` / `EXTENSIBLE_KV_*` name -> the files that read it: Python string constants
    (not docstrings), Rust string literals outside comments, shell `$NAME` / `${NAME…}`."""
    reads: dict[str, set[str]] = {}

    def add(name: str, path: Path) -> None:
        reads.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())

    for path in _sources("python", "tests", "benchmarks", "scripts", ext=".py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and ENV_NAME.match(node.value)
            ):
                add(node.value, path)
    for path in _sources("src", "tests", "benches", ext=".rs"):
        code = re.sub(r"//.*", "", path.read_text())
        for name in re.findall(r'"((?:EKV|EXTENSIBLE_KV)_[A-Z0-9_]+)"', code):
            add(name, path)
    shell = [ROOT / f for f in repo_files() if f.startswith(("scripts/", ".ci/"))]
    for path in shell:
        if path.suffix == ".py" or not path.read_text().startswith("#!"):
            continue
        code = "\n".join(line.split(" #")[0] for line in path.read_text().splitlines())
        code = re.sub(r"^\s*#.*", "", code, flags=re.M)
        for name in re.findall(r"\$\{?((?:EKV|EXTENSIBLE_KV)_[A-Z0-9_]+)", code):
            add(name, path)
    return reads


# ---------------------------------------------------------------------------------------------
# checking one token


def check_token(token: Token) -> str | None:
    """None when the token names something that exists (or is not checkable), else why not."""
    text = token.text.strip()
    if "://" in text or text.startswith(("/", "../", "~")):
        return None  # a URL, or a path outside the repository
    if re.fullmatch(r"\.\w+", text):
        return None  # a file extension
    if " " in text:
        first = text.split(" ")[0]
        return check_path(first) if _is_repo_path(first) else None
    if re.fullmatch(r"(EKV|EXTENSIBLE_KV)_[A-Z0-9_]+(=.*)?", text):
        name = text.split("=")[0]
        return None if name in env_reads() else "no code reads this environment variable"
    if _is_repo_path(text) or text.endswith(EXTENSIONS):
        return check_path(text)
    if text == "extensible_kv" or text.startswith(("extensible_kv.", "extensible_kv:")):
        return check_python_name(text)
    if "::" in text:
        return check_rust_path(text)
    return check_identifier(text)


def _is_repo_path(text: str) -> bool:
    path = re.split(r"[:§]", text)[0]
    if path.startswith(GENERATED_PREFIXES):
        return False
    top = path.split("/")[0]
    return ("/" in path or path.endswith(EXTENSIONS)) and (
        top in {f.split("/")[0] for f in repo_files()}
        or path.endswith(EXTENSIONS)
        or any(f"/{path.rstrip('/')}/" in f"/{f}" for f in repo_files())
    )


def check_path(text: str) -> str | None:
    path = re.split(r"[:§ ]", text)[0].rstrip(",")
    if text in FOREIGN_NAMES or path in FOREIGN_NAMES:
        return None
    if path.startswith(GENERATED_PREFIXES):
        return None
    brace = re.search(r"\{([^}]*)\}", path)
    if brace:
        variants = [path[: brace.start()] + v + path[brace.end() :] for v in brace[1].split(",")]
        missing = [v for v in variants if check_path(v)]
        return f"no such file: {', '.join(missing)}" if missing else None
    if path.endswith("/"):
        name = path.rstrip("/")
        if name in repo_dirs() or any(d.endswith(f"/{name}") for d in repo_dirs()):
            return None
        return "no such directory in the repository"
    if any(ch in path for ch in "*?["):
        if any(Path(f).match(path) for f in repo_files()):
            return None
        return "the glob matches no file in the repository"
    if path in repo_files() or path in repo_dirs():
        return None
    if any(f.endswith(f"/{path}") for f in repo_files()):
        return None  # a file named by its tail: `mod.rs`, `host/stray.rs`
    return "no such file in the repository"


def check_python_name(text: str) -> str | None:
    """`extensible_kv.a.b.C.d`, or `extensible_kv.a:b`: a module, then names bound in it."""
    dotted = re.sub(r"\(.*\)$", "", text).replace(":", ".")
    parts = dotted.split(".")
    modules = python_modules()
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            return _resolve_in_module(module, parts[cut:], text)
    return f"no module {parts[0]} under python/"


def _resolve_in_module(module: str, rest: list[str], text: str, depth: int = 0) -> str | None:
    if not rest:
        return None
    modules = python_modules()
    info = modules[module]
    head, *tail = rest
    if f"{module}.{head}" in modules:
        return _resolve_in_module(f"{module}.{head}", tail, text, depth)
    if head in info.imported and depth < 5:  # follow a re-export to its definition
        source_module, name = info.imported[head].rsplit(".", 1)
        if source_module in modules:
            return _resolve_in_module(source_module, [name, *tail], text, depth + 1)
        return None  # imported from another project
    if head not in info.names:
        return f"{module} binds no name {head!r}"
    if tail and head in info.classes:
        return _check_member(module, head, tail[0])
    return None


def _check_member(module: str, cls: str, member: str) -> str | None:
    """`member` is defined on our class `cls` or one of its bases of ours."""
    modules = python_modules()
    seen, todo = set(), [(module, cls)]
    while todo:
        mod, name = todo.pop()
        if (mod, name) in seen:
            continue
        seen.add((mod, name))
        info = modules[mod]
        if name in info.imported:
            source_module, name = info.imported[name].rsplit(".", 1)
            if source_module not in modules:
                return None  # a class of another project: cannot check
            todo.append((source_module, name))
            continue
        if name not in info.classes:
            continue
        if member in info.classes[name]:
            return None
        for base in info.bases[name]:
            if "." in base:
                return None  # a base of another project (torch, vLLM): cannot check
            todo.append((mod, base))
    return f"{cls} (in {module}) has no member {member!r}"


def _our_class(name: str) -> list[tuple[str, str]]:
    """The (module, class) pairs where our Python defines a class of this name."""
    return [(mod, name) for mod, info in python_modules().items() if name in info.classes]


def check_rust_path(text: str) -> str | None:
    path = re.sub(r"\(.*\)$", "", text)
    path = re.sub(r"\s*\{.*\}$", "", path)
    parts = [p for p in path.split("::") if p not in ("crate", "self", "super")]
    if text in FOREIGN_NAMES or path in FOREIGN_NAMES:
        return None
    unknown = [p for p in parts if p not in rust_index() and p not in file_names()]
    if unknown and not (len(unknown) == 1 and unknown[-1] in STD_METHODS):
        return f"no Rust item named {', '.join(unknown)} in src/"
    owner, item = parts[-2], parts[-1]
    if item in STD_METHODS:
        return None
    files = _rust_module_files(owner) or _rust_type_files(owner)
    if files and not any(item in rust_items()[f] for f in files):
        return f"{item} is not defined in {owner} ({', '.join(sorted(files))})"
    return None


def check_identifier(text: str) -> str | None:
    """A bare name, a call, a keyword argument, `Name { .. }`, `Name<T>` or `Owner.member`."""
    if text in FOREIGN_NAMES:
        return None
    name = re.sub(r"\(.*\)$", "", text)  # name(args)
    name = re.sub(r"=.*$", "", name)  # name=value
    name = re.sub(r"\s*[{<].*$", "", name)  # Name { fields }, Name<T>
    if not re.fullmatch(r"[A-Za-z_][\w.]*!?", name):
        return None  # an expression, a shape, a number, a string: not a name
    if re.fullmatch(r"[0-9a-f]{7,40}", name) or name in FOREIGN_NAMES:
        return None  # a commit hash (checked by git below), or not ours
    if any(p.match(name) for p in FOREIGN_PATTERNS):
        return None
    head, *rest = name.split(".")
    if head in ALIASES:
        return check_python_name(".".join([ALIASES[head], *rest]))
    if head in FOREIGN_MODULES and rest:
        return None
    if rest:
        if head[0].isupper() and not _known(head):
            return f"no class or module {head!r} in python/ or src/"
        if _our_class(head):
            problems = [_check_member(m, c, rest[0]) for m, c in _our_class(head)]
            return None if None in problems else problems[0]
        modules = [m for m in python_modules() if m.split(".")[-1] == head]
        problems = [_resolve_in_module(m, rest, text) for m in modules]
        if modules and None in problems:
            return None
        # `flow.cache.views`, `state.mappings`: a variable's attribute, checked as a name.
        if not _known(rest[-1]):
            return problems[0] if problems else f"{rest[-1]!r} is defined nowhere"
        return None
    if _known(name):
        return None
    return (
        "defined nowhere in python/, src/, tests/, benchmarks/ or scripts/ (add it to "
        "FOREIGN in tests/test_docs.py if it is another project's)"
    )


def _known(name: str) -> bool:
    return (
        name in python_index()
        or name in rust_index()
        or name.rstrip("!") in rust_index()
        or name in file_names()
        or hasattr(builtins, name)
        or keyword.iskeyword(name)
        or any(hasattr(module, name) for module in (errno, mmap, fcntl, socket))
    )


# ---------------------------------------------------------------------------------------------
# the tests


def _failures(tokens: list[Token]) -> list[str]:
    return [token.fail(why) for token in tokens if (why := check_token(token)) is not None]


def test_every_backticked_name_in_the_docs_exists() -> None:
    tokens = [t for doc in DOCS for t in doc_tokens(doc)]
    assert len(tokens) > 500  # the parser read the docs
    failures = _failures(tokens)
    assert not failures, "\n" + "\n".join(failures)


def test_the_checker_catches_what_is_stale() -> None:
    # Each of these once stood in docs/design.md, or could: the checker must refuse them.
    stale = [
        "src/tensor.rs",  # a moved file
        "src/driver/nothing.rs",
        "tests/test_nothing_*.py",  # a glob that matches nothing
        "extensible_kv.vllm.NoSuchClass",
        "extensible_kv.nothing",
        "ExtensibleKVCache.no_such_method",
        "BufferGeometry",  # a renamed class
        "ViewGeometry.per_segment",  # a member of a renamed class
        "resolve_stream",  # a removed function
        "plan::no_such_fn",
        "Options::no_such_field",
        "EXTENSIBLE_KV_NOTHING=1",
        "scripts/nothing --flag",
    ]
    for text in stale:
        assert check_token(Token("x.md", 1, text)) is not None, text
    fine = [
        "src/driver/",
        "tests/test_*.py",
        "src/driver/{mod,books}.rs",
        "docs/design.md §4",
        "extensible_kv.vllm.plugin:register",
        "ExtensibleKVCache.shrink_to(n)",
        "plan::HandlePolicy",
        "GrowOptions::default()",
        "cuMemCreate",
        "ENOMEM",
        "/proc/self/fd",
        "scripts/vendor-vllm --check",
    ]
    for text in fine:
        assert check_token(Token("x.md", 1, text)) is None, (text, check_token(Token("", 1, text)))


def test_commits_the_docs_cite_exist() -> None:
    """Short hashes in backticks name commits of this repository (skipped without its history)."""
    hashes = {
        (t.file, t.line, t.text)
        for doc in DOCS
        for t in doc_tokens(doc)
        if re.fullmatch(r"[0-9a-f]{7,40}", t.text)
    }
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to look the commits up in")
    shallow = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
    )
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone: the cited commits may predate its history")
    missing = []
    for file, line, sha in sorted(hashes):
        probe = subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{sha}^{{commit}}"],
            capture_output=True,
        )
        if probe.returncode != 0:
            missing.append(f"{file}:{line}: `{sha}`: no such commit")
    assert not missing, "\n" + "\n".join(missing)


# ---------------------------------------------------------------------------------------------
# lists the code can make itself


def _section(doc: str, heading: str) -> tuple[int, list[str]]:
    """The lines of a section (up to the next heading of its level or higher), and the line
    number of its first line."""
    lines = (ROOT / doc).read_text().splitlines()
    level = heading.split(" ")[0]
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    assert start is not None, f"{doc}: no heading {heading!r}"
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if re.match(r"#+ ", lines[i]) and len(lines[i].split(" ")[0]) <= len(level)
        ),
        len(lines),
    )
    return start + 1, lines[start:end]


def _unsafe_sites() -> tuple[set[str], set[str]]:
    """Files that allow `unsafe_code` for the whole module, and files that allow it on items."""
    modules, items = set(), set()
    for path in _sources("src", ext=".rs"):
        code = re.sub(r"//.*", "", path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        if "#![allow(unsafe_code)]" in code:
            modules.add(rel)
        if re.search(r"#\[allow\(unsafe_code\)\]", code):
            items.add(rel)
    return modules, items


def _bullet_paths(lines: list[str], marker: str) -> set[str]:
    """The `src/…` paths opening the bullets of the list that follows the line with `marker`."""
    start = next((i for i, line in enumerate(lines) if marker in line), None)
    assert start is not None, f"no line introduces the list with {marker!r}"
    paths, in_list = set(), False
    for line in lines[start + 1 :]:
        if line.startswith("- "):
            in_list = True
            found = re.match(r"- `(src/[^`]+\.rs)`", line)
            if found:
                paths.add(found[1])
        elif in_list and line.strip() and not line.startswith("  "):
            break
    return paths


def test_the_unsafe_modules_listed_are_the_code_s() -> None:
    first, lines = _section("docs/design.md", "### 3.6")
    modules, items = _unsafe_sites()
    listed_modules = _bullet_paths(lines, "`#![allow(unsafe_code)]`")
    listed_items = _bullet_paths(lines, "`#[allow(unsafe_code)]`")
    where = f"docs/design.md:{first} (§3.6)"
    assert listed_modules == modules, (
        f"{where}: modules listed but not allowing unsafe: {sorted(listed_modules - modules)}; "
        f"allowing unsafe but not listed: {sorted(modules - listed_modules)}"
    )
    assert listed_items == items, (
        f"{where}: item-level sites listed but absent: {sorted(listed_items - items)}; "
        f"present but not listed: {sorted(items - listed_items)}"
    )
    crate = (ROOT / "Cargo.toml").read_text()
    assert re.search(r'^unsafe_code = "deny"$', crate, re.M), "Cargo.toml no longer denies it"


def _env_table() -> dict[str, tuple[int, list[str]]]:
    """README's environment-variable table: name -> (line, the paths its reader column names)."""
    first, lines = _section("README.md", "## Environment variables")
    rows = {}
    for offset, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 4:
            continue
        name = re.match(r"`((?:EKV|EXTENSIBLE_KV)_[A-Z0-9_]+)`", cells[0])
        if name:
            rows[name[1]] = (first + offset, re.findall(r"`([^`]*/[^`]*)`", cells[-1]))
    return rows


def test_the_readme_lists_every_environment_variable_the_code_reads() -> None:
    reads, table = env_reads(), _env_table()
    missing = sorted(set(reads) - set(table))
    assert not missing, f"README.md: the code reads {missing} (in {[reads[m] for m in missing]})"
    problems = []
    for name, (line, readers) in sorted(table.items()):
        if name not in reads:
            problems.append(f"README.md:{line}: `{name}`: no code reads it")
            continue
        if not readers:
            problems.append(f"README.md:{line}: `{name}`: the row names no reader")
        for reader in readers:
            files = [f for f in repo_files() if f == reader or f.startswith(reader.rstrip("/"))]
            if not any(f in reads[name] for f in files):
                problems.append(
                    f"README.md:{line}: `{name}`: `{reader}` does not read it "
                    f"(read in {sorted(reads[name])})"
                )
    assert not problems, "\n" + "\n".join(problems)


def test_env_reads_sees_each_way_of_reading() -> None:
    reads = env_reads()
    # A constant in a plugin, a Rust const, a shell default, a Python os.environ.get literal.
    assert "python/extensible_kv/vllm/plugin.py" in reads["EXTENSIBLE_KV_VLLM"]
    assert "src/driver/host/stray.rs" in reads["EXTENSIBLE_KV_STRAY_REPORT"]
    assert "scripts/setup" in reads["EKV_SETUP_VLLM"]
    assert "benches/mapping.rs" in reads["EKV_BENCH_DEVICE"]


# ---------------------------------------------------------------------------------------------
# links inside the docs


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: the rendered text lowercased, all
    but letters, digits, `_`, `-` and spaces dropped, spaces made `-`; repeats get `-1`, `-2`."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_links_to_headings_resolve() -> None:
    """`[text](#anchor)` and `[text](file.md#anchor)` in the docs name a heading that exists."""
    problems = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            target, anchor = match.groups()
            path = (ROOT / doc).parent / target if target else ROOT / doc
            line = text.count("\n", 0, match.start()) + 1
            if not path.is_file():
                problems.append(f"{doc}:{line}: link to {target}: no such file")
            elif anchor not in heading_anchors(path.read_text()):
                problems.append(f"{doc}:{line}: #{anchor}: no such heading in {target or doc}")
    assert not problems, "\n" + "\n".join(problems)


def test_anchors_follow_github() -> None:
    anchors = heading_anchors("# A `b.py` (c, d)\n## A `b.py` (c, d)\n### µs — x\n")
    assert anchors == {"a-bpy-c-d", "a-bpy-c-d-1", "µs--x"}


# ---------------------------------------------------------------------------------------------
# claims of place: a name said to live in a file, a block said to be verbatim, a list said to
# be a trait's methods


@functools.cache
def definitions() -> dict[str, frozenset[str]]:
    """Source file -> the names it defines: Rust items, fields and variants; Python functions,
    classes, parameters and assignment targets. Not its imports: a re-export is not a home."""
    found = dict(rust_items())
    tops = ("python", "tests", "benchmarks", "scripts", "examples")
    for path in _sources(*tops, ext=".py") + _sources("python", ext=".pyi"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        found[path.relative_to(ROOT).as_posix()] = frozenset(names)
    return found


@dataclass(frozen=True)
class Claim:
    """`name`, as a doc writes it, said to be defined in `home` (a file, a file's tail, or a
    directory), read relative to `base` (the directory of the table row it stands in)."""

    file: str
    line: int
    name: str
    home: str
    base: str = ""

    def fail(self, why: str) -> str:
        return f"{self.file}:{self.line}: `{self.name}` in `{self.home}`: {why}"


def _claimed_name(text: str) -> str | None:
    """The identifier a backticked token names (`a::b::c()` -> `c`), or None for a token that
    is no identifier (a path, an expression, an environment variable)."""
    name = re.sub(r"\(.*\)$", "", text.strip())
    name = re.sub(r"\s*(=.*|[{<].*)$", "", name).rstrip("!")
    if "/" in name or name.endswith(EXTENSIONS) or ENV_NAME.match(name):
        return None
    if not re.fullmatch(r"[A-Za-z_]\w*((::|\.)[A-Za-z_]\w*)*", name):
        return None
    return re.split(r"::|\.", name)[-1]


def _is_source_path(text: str) -> bool:
    path = re.split(r"[:§ ]", text)[0]
    return (path.endswith("/") or path.endswith((".rs", ".py", ".pyi"))) and _is_repo_path(path)


def home_files(home: str, base: str = "") -> list[str]:
    """The source files a doc's path names: that file, the files a tail names (those under
    `base` where some are), every file under a directory; `{a,b}` expands."""
    path = re.split(r"[:§ ]", home)[0]
    brace = re.search(r"\{([^}]*)\}", path)
    if brace:
        variants = [path[: brace.start()] + v + path[brace.end() :] for v in brace[1].split(",")]
        return [f for v in variants for f in home_files(v, base)]
    files = list(definitions())
    if path.endswith("/"):
        hits = [f for f in files if f.startswith(path) or f"/{path}" in f"/{f}"]
    else:
        hits = [f for f in files if f == path or f.endswith(f"/{path}")]
    under = [f for f in hits if base and f.startswith(base)]
    return under or hits


def _where_column(header: list[str]) -> int | None:
    for i, cell in enumerate(header):
        if cell.strip().lower() in ("files", "where"):
            return i
    return None


def _cells(row: str) -> list[str]:
    """A table row's cells; `\\|` inside a cell is a literal bar."""
    return re.split(r"(?<!\\)\|", row.strip().strip("|"))


def _is_full_path(text: str) -> bool:
    """A path from the repository's root (`examples/decoder/`), which says its own place."""
    top = text.split("/")[0]
    return "/" in text and top in {f.split("/")[0] for f in repo_files()}


def _row_bases(text: str) -> dict[int, str]:
    """Line -> the directory a table row with a `files` or `where` column is about."""
    bases, where, previous = {}, None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            where, previous = None, line
            continue
        cells = _cells(line)
        if not previous.startswith("|"):  # the header
            where, previous = _where_column(cells), line
            continue
        previous = line
        if where is None or where >= len(cells):
            continue
        paths = re.findall(r"`([^`]+)`", cells[where])
        if paths and _is_source_path(paths[0]):
            bases[number] = paths[0] if paths[0].endswith("/") else paths[0].rsplit("/", 1)[0] + "/"
    return bases


def _table_claims(doc: str, text: str, bases: dict[int, str]) -> list[Claim]:
    """In a table with a `files` or `where` column, each unqualified name of a row's last
    column (`Books<H>`, `refuse_map`, a module such as `headroom`) lives under the row's path.
    A qualified name (`Error::Closed`, `_torch.require`) or a full path says its own place,
    and `name=value` is a use, not a home."""
    claims = []
    lines = text.splitlines()
    for number, base in bases.items():
        for token in re.findall(r"`([^`]+)`", _cells(lines[number - 1])[-1]):
            bare = re.sub(r"\(.*\)$", "", token)
            if "::" in bare or "." in bare or "=" in bare or _is_full_path(bare):
                continue
            claims.append(Claim(doc, number, token, base, base))
    return claims


# `NAME` in `PATH`, `NAME` = 1 GiB in `PATH`, `NAME` (in `PATH`)
_IN_PATH = re.compile(r"`([^`]+)`(\s*=\s*[^`;,()]*?)?\s+\(?in\s+`([^`]+)`")
# `NAME` (`PATH`...)
_PATH_AFTER = re.compile(r"`([^`]+)`\s+\(`([^`]+)`[,;)]")
# `PATH` (... `NAME` ...): the names in the parentheses after a path
_NAMES_AFTER = re.compile(r"`([^`]+)`\s+\(([^()]*)\)")
# `PATH`: ... `NAME` ...; up to the clause's end
_PATH_COLON = re.compile(r"`([^`]+)`:\s+([^;|]*?)(?:;|\|| \(§|\.\s|\.$|$)", re.M)


def _prose_claims(doc: str, text: str, bases: dict[int, str]) -> list[Claim]:
    """Names a sentence places in a file: `X` in `P`, `X` (`P`), `P` (`X`, `Y`), `P`: `X`.
    In a table row about a directory, a file's tail is read under that directory."""
    found = []

    def line_of(position: int) -> int:
        return text.count("\n", 0, position) + 1

    for match in _IN_PATH.finditer(text):
        found.append((match.start(), match[1], match[3]))
    for match in _PATH_AFTER.finditer(text):
        if not _is_source_path(match[1]):
            found.append((match.start(), match[1], match[2]))
    for pattern in (_NAMES_AFTER, _PATH_COLON):
        for match in pattern.finditer(text):
            for token in re.finditer(r"`([^`]+)`", match[2]):
                if not _is_full_path(token[1]):
                    found.append((match.start(2) + token.start(), token[1], match[1]))
    claims = []
    for position, name, home in found:
        line = line_of(position)
        if _is_source_path(home) and " " not in home:
            claims.append(Claim(doc, line, name, home, bases.get(line, "")))
    return claims


def home_claims(doc: str) -> list[Claim]:
    text = prose(doc)
    bases = _row_bases(text)
    return _table_claims(doc, text, bases) + _prose_claims(doc, text, bases)


def check_claim(claim: Claim) -> str | None:
    """None when the claim holds or cannot be checked (the name is not ours), else why not."""
    homes = home_files(claim.home, claim.base)
    if not homes:
        return None  # a missing path: the name check reports it
    token = claim.name.strip()
    if _is_source_path(token) or token.endswith(EXTENSIONS):
        tail = re.split(r"[:§ ]", token)[0].rstrip("/")
        if any(f"/{tail}/" in f"/{f}" or f.endswith(f"/{tail}") for f in homes):
            return None
        return "no such file there"
    name = _claimed_name(token)
    if name is None or name in STD_METHODS or token in FOREIGN_NAMES:
        return None
    defined = [f for f, names in definitions().items() if name in names]
    modules = {part for f in homes for part in Path(f).with_suffix("").parts}
    if any(f in defined for f in homes) or (claim.base and name in modules):
        return None
    if not defined:
        return None  # not ours: vLLM's, CUDA's, Linux's (the name check vouches for the rest)
    return f"not defined there; defined in {', '.join(sorted(defined)[:4])}"


def test_names_said_to_live_in_a_file_are_defined_there() -> None:
    claims = [c for doc in DOCS for c in home_claims(doc)]
    assert len(claims) > 100  # the parser found the claims
    failures = [c.fail(why) for c in claims if (why := check_claim(c)) is not None]
    assert not failures, "\n" + "\n".join(failures)


def test_the_claim_checker_catches_a_name_out_of_place() -> None:
    text = (
        "| layer | where | what |\n|---|---|---|\n"
        "| driver | `src/driver/` | `books`, `ipc` (pidfds), `Books<H>`, `Error::Closed` |\n"
        "\nThe cap (`DEFAULT_MAX_HANDLE_BYTES` = 1 GiB in `src/tensor/mod.rs`); `Geometry` "
        "(`src/tensor/`); `src/plan.rs` (`plan_grow`, `Mapping`); `mapping.rs`: `Reservation`.\n"
    )
    bases = _row_bases(text)
    claims = _table_claims("x.md", text, bases) + _prose_claims("x.md", text, bases)
    failing = {c.name for c in claims if check_claim(c)}
    assert failing == {"ipc", "DEFAULT_MAX_HANDLE_BYTES", "Geometry", "Mapping"}
    assert {c.name for c in claims} >= {"books", "Books<H>", "plan_grow", "Reservation"}


def _comment_text(source: str) -> str:
    """A source's lines with comment and quote markers dropped, whitespace collapsed."""
    lines = [re.sub(r"^\s*(//[!/]?|#|>)\s?", "", line) for line in source.splitlines()]
    return " ".join(" ".join(lines).split())


def verbatim_quotes(doc: str) -> list[tuple[int, str, str]]:
    """(line, path, quote) for each block a line introduces as verbatim from a file: the
    blockquote or fenced block after a line that says `verbatim` and ends with a colon."""
    lines = (ROOT / doc).read_text().splitlines()
    quotes = []
    for number, line in enumerate(lines, 1):
        if "verbatim" not in line.lower() or not line.rstrip().endswith(":"):
            continue
        paths = [p for p in re.findall(r"`([^`]+)`", line) if _is_repo_path(p)]
        assert paths, f"{doc}:{number}: a verbatim quote names no file to compare it with"
        rest = lines[number:]
        while rest and not rest[0].strip():
            rest = rest[1:]
        if rest and rest[0].startswith("```"):
            end = next(i for i in range(1, len(rest)) if rest[i].startswith("```"))
            block = rest[1:end]
        else:
            quoted = (i for i, text in enumerate(rest) if not text.startswith(">"))
            block = rest[: next(quoted, len(rest))]
        assert block, f"{doc}:{number}: no block follows the verbatim claim"
        quotes.append((number, paths[0], "\n".join(block)))
    return quotes


def test_verbatim_quotes_equal_their_source() -> None:
    quotes = verbatim_quotes("docs/design.md")
    assert quotes  # the invariants of src/tensor/mod.rs are quoted
    problems = []
    for doc in DOCS:
        for line, path, quote in verbatim_quotes(doc):
            source = _comment_text((ROOT / re.split(r"[:§ ]", path)[0]).read_text())
            if _comment_text(quote) not in source:
                problems.append(f"{doc}:{line}: the block quoted from `{path}` is not in it")
    assert not problems, "\n" + "\n".join(problems)


def test_the_verbatim_check_sees_a_drift() -> None:
    source = "//! 1. one;\n//! 2. two words\n//!    wrapped;\n"
    assert _comment_text("> 2. two words wrapped;") in _comment_text(source)
    assert _comment_text("> 2. two words, wrapped;") not in _comment_text(source)


def trait_methods(path: str, trait: str) -> list[str]:
    """The methods a Rust trait declares, in order (default methods included)."""
    code = re.sub(r"//.*", "", (ROOT / path).read_text())
    start = re.search(rf"\btrait\s+{trait}\b[^{{]*\{{", code)
    assert start, f"{path}: no trait {trait}"
    depth, end = 1, start.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(code[end], 0)
        end += 1
    body = code[start.end() : end - 1]
    while re.search(r"\{[^{}]*\}", body):  # default methods' bodies, innermost first
        body = re.sub(r"\{[^{}]*\}", ";", body)
    return re.findall(r"\bfn\s+(\w+)", body)


def test_the_driver_methods_design_lists_are_the_trait_s() -> None:
    first, lines = _section("docs/design.md", "### 3.1")
    row = next((i for i, line in enumerate(lines) if "The `Driver` trait:" in line), None)
    assert row is not None, f"docs/design.md:{first}: §3.1 no longer lists the `Driver` trait"
    listed = lines[row].split("The `Driver` trait:", 1)[1].split(". ", 1)[0]
    documented = re.findall(r"`(\w+)`", listed)
    methods = trait_methods("src/driver/mod.rs", "Driver")
    assert len(methods) >= 14  # the parser read the trait
    where = f"docs/design.md:{first + row} (§3.1)"
    assert sorted(documented) == sorted(methods), (
        f"{where}: listed but not in the trait: {sorted(set(documented) - set(methods))}; "
        f"in the trait but not listed: {sorted(set(methods) - set(documented))}"
    )
