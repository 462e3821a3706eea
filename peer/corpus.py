"""The built-in training corpus: English documentation text that every CPython install ships, built with no network.

Sources, in a fixed order so that every peer with the same Python version builds byte-identical data:
  (a) `pydoc_data.topics.topics`: the language reference topics behind `help()`, one document per topic;
  (b) docstrings of the standard library's own .py files, read with `ast` (nothing is imported), rendered like
      pydoc pages: one document per module (module docstring + documented top-level functions) and one per
      documented class (class docstring + documented methods), each with a title and `def` signature lines.
A class gets its own document rather than living inside its module's page so the corpus has well over a thousand
documents: the held-out split is by document (peer/data.py), and coarse documents would make it lumpy.

The result is a JSON-lines file ({"text", "source"} per line) cached under $SPES_CACHE_DIR or
~/.cache/spes-swarm/, named after the Python version because the stdlib (and so the corpus) differs between them.
"""
from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

# Bump when the rendering changes, so caches built by older code are not reused.
CORPUS_FORMAT = 1
# Directories of the stdlib that are not documentation: tests, IDLE, the retired 2to3, third-party packages, and
# ~100 machine-generated near-identical codec modules (duplicates would leak across the held-out split).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "encodings",
                        "__pycache__"})
MIN_DOCUMENT_CHARS = 200
_MAX_SIGNATURE_CHARS = 200

_Def = (ast.FunctionDef, ast.AsyncFunctionDef)


def cache_dir() -> Path:
    """Where built artifacts are cached: $SPES_CACHE_DIR, else ~/.cache/spes-swarm."""
    env = os.environ.get("SPES_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spes-swarm"


def builtin_corpus_path() -> Path:
    """Return the path of the built-in corpus JSONL file, building it first if it is not cached yet."""
    version = ".".join(str(v) for v in sys.version_info[:3])
    path = cache_dir() / f"builtin-corpus-v{CORPUS_FORMAT}-py{version}.jsonl"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    n_docs = n_bytes = 0
    # Write to a temp file in the same directory and rename: peers started together may all build at once, and
    # none of them may ever read a half-written file; the last rename wins with identical content.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for text, source in iter_builtin_documents():
                line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
                data = line.encode("utf-8")
                f.write(data)
                n_docs += 1
                n_bytes += len(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the cache may be shared by several users' peers
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    logger.info(f"Built the built-in corpus: {n_docs} documents, {n_bytes / 1e6:.1f} MB in "
                f"{time.perf_counter() - start:.1f} s -> {path}")
    return path


def iter_builtin_documents() -> Iterator[tuple[str, str]]:
    """Yield (text, source) for every document of the built-in corpus, in a deterministic order."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = topics[key].strip()
        if len(text) >= MIN_DOCUMENT_CHARS:
            yield _clean(f"Python language reference: {key}\n\n{text}\n"), f"pydoc_data.topics:{key}"
    yield from _iter_stdlib_documents(Path(sysconfig.get_paths()["stdlib"]))


def _iter_stdlib_documents(root: Path) -> Iterator[tuple[str, str]]:
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not any(part in _SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            files.append(rel)
    # Sort on the POSIX string so the order never depends on the file system's listing order.
    for rel in sorted(files, key=lambda p: p.as_posix()):
        try:
            tree = ast.parse((root / rel).read_bytes(), filename=str(rel))
        except (SyntaxError, ValueError, OSError):
            continue  # e.g. a file written for another Python version; skipping it is deterministic too
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts) if parts else rel.stem
        for text, source in _module_documents(module, tree):
            if len(text) >= MIN_DOCUMENT_CHARS:
                yield _clean(text), source


def _sections(node: ast.Module | ast.ClassDef, prefix: str) -> list[str]:
    """The node's own docstring, then one section per function/method defined directly in it."""
    sections = []
    doc = ast.get_docstring(node)
    if doc:
        sections.append(doc)
    for child in node.body:
        if isinstance(child, _Def):
            section = _function_section(child, prefix=prefix)
            if section:
                sections.append(section)
    return sections


def _module_documents(module: str, tree: ast.Module) -> Iterator[tuple[str, str]]:
    sections = _sections(tree, prefix="")
    if sections:
        yield _page(f"Module {module}", sections), f"stdlib:{module}"
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            yield from _class_documents(module, node, qualname=node.name)


def _class_documents(module: str, node: ast.ClassDef, qualname: str) -> Iterator[tuple[str, str]]:
    sections = _sections(node, prefix=f"{node.name}.")
    if sections:
        title = f"class {module}.{qualname}{_bases(node)}"
        yield _page(title, sections), f"stdlib:{module}.{qualname}"
    for child in node.body:
        if isinstance(child, ast.ClassDef):
            yield from _class_documents(module, child, qualname=f"{qualname}.{child.name}")


def _function_section(node: ast.FunctionDef | ast.AsyncFunctionDef, prefix: str) -> str | None:
    doc = ast.get_docstring(node)
    if not doc:
        return None
    signature = _unparse(node.args)
    if node.returns is not None:
        signature += f") -> {_unparse(node.returns)}"
    else:
        signature += ")"
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{keyword} {prefix}{node.name}({signature}\n{doc}"


def _bases(node: ast.ClassDef) -> str:
    if not node.bases:
        return ""
    return "(" + ", ".join(_unparse(b) for b in node.bases) + ")"


def _unparse(node: ast.AST) -> str:
    text = ast.unparse(node)
    # A default like a big dict literal would swamp the page; pydoc elides such values too.
    return text if len(text) <= _MAX_SIGNATURE_CHARS else text[:_MAX_SIGNATURE_CHARS] + "..."


def _page(title: str, sections: list[str]) -> str:
    return title + "\n" + "=" * len(title) + "\n\n" + "\n\n".join(sections) + "\n"


def _clean(text: str) -> str:
    # A docstring may spell a lone surrogate ("\ud800"); it has no UTF-8 form, so it becomes U+FFFD.
    return text.encode("utf-8", "replace").decode("utf-8")
