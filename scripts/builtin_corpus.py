"""The corpus of genlab's built-in models: Python source installed on the build machine,
split by file, and the chat pairs made from it.

Used by `scripts/train_default_model.py` (training) and `benchmarks/builtin_quality.py`
(the held-out checks). Both see the same files in the same order, so the held-out split
is the same: every `holdout_every`th file of the sorted list, counted over the whole
corpus, is never trained on.

Sources: the standard library (PSF licence) and the packages in `PACKAGES`, each under a
permissive licence (MIT, BSD, Apache-2.0), read from wherever they are installed. A
package that is not installed is left out and the record says so.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.metadata as metadata
import json
import random
import sys
import sysconfig
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

# Top-level stdlib entries left out: tests, third-party code, GUI and demo code,
# generated codec tables, a large generated docs string, and build leftovers.
SKIP_TOP = {"site-packages", "dist-packages", "test", "idlelib", "lib2to3", "tkinter",
            "turtledemo", "ensurepip", "encodings", "pydoc_data", "lib-dynload",
            "__pycache__", "__phello__"}
SKIP_ANY = {"test", "tests", "testing", "__pycache__", "_vendor", "vendor", "vendored",
            "benchmarks", "examples"}
MAX_FILE_BYTES = 200_000  # larger files are generated tables or data
MAX_LINE = 400  # a longer line means data or minified code
PER_PACKAGE_BYTES = 3_000_000  # no one package's style dominates

# (distribution, top-level import folders): permissively licensed, mostly hand-written
# Python. Large packages are taken whole; the corpus is capped by `max_bytes`.
PACKAGES = [
    ("transformers", ["transformers"]), ("sympy", ["sympy"]), ("pandas", ["pandas"]),
    ("scipy", ["scipy"]), ("networkx", ["networkx"]), ("numpy", ["numpy"]),
    ("pip", ["pip"]), ("setuptools", ["setuptools"]), ("rich", ["rich"]),
    ("Pygments", ["pygments"]), ("pytest", ["_pytest"]), ("huggingface_hub",
    ["huggingface_hub"]), ("accelerate", ["accelerate"]), ("pydantic", ["pydantic"]),
    ("trio", ["trio"]), ("prompt_toolkit", ["prompt_toolkit"]), ("jedi", ["jedi"]),
    ("ipython", ["IPython"]), ("mpmath", ["mpmath"]), ("fsspec", ["fsspec"]),
    ("Werkzeug", ["werkzeug"]), ("typer", ["typer"]), ("click", ["click"]),
    ("Jinja2", ["jinja2"]), ("attrs", ["attr", "attrs"]), ("requests", ["requests"]),
]
PERMISSIVE = ("mit", "bsd", "apache", "psf", "python software foundation", "0bsd")


@dataclass(frozen=True)
class SourceFile:
    source: str  # "stdlib" or a distribution name
    rel: str  # path inside its source, posix
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[SourceFile]
    held: list[SourceFile]
    sources: list[dict[str, str]]
    sha256: str


def _stdlib() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP_TOP or rel.parts[0].startswith("config-"):
            continue
        if SKIP_ANY.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        files.append(rel)
    return root, sorted(files, key=lambda r: r.as_posix())


def _licence(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"].strip()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or []
                   if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    lines = (meta.get("License") or "").strip().splitlines()
    return lines[0] if lines else ""


def _package(name: str, folders: list[str]) -> tuple[dict[str, str], list[tuple[Path, Path]]]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return {"name": name, "status": "not installed"}, []
    licence = _licence(dist)
    info = {"name": name, "version": dist.version, "licence": licence}
    if not any(word in licence.lower() for word in PERMISSIVE):
        return {**info, "status": "skipped: licence not recognised as permissive"}, []
    base = Path(str(dist.locate_file("")))
    files = []
    for folder in folders:
        root = base / folder
        for path in sorted(root.rglob("*.py")) if root.is_dir() else []:
            rel = path.relative_to(base)
            if not SKIP_ANY.intersection(rel.parts[:-1]):
                files.append((base, rel))
    return {**info, "status": "used"}, files


def _usable(text: str) -> bool:
    return len(text) <= MAX_FILE_BYTES and all(len(line) <= MAX_LINE
                                               for line in text.splitlines())


def load(smoke: bool, holdout_every: int, with_packages: bool, max_bytes: int) -> Corpus:
    """Every file in a fixed order; every `holdout_every`th held out."""
    root, rels = _stdlib()
    listing: list[tuple[str, Path, Path]] = [("stdlib", root, r) for r in rels]
    sources = [{"name": "stdlib", "version": sys.version.split()[0],
                "licence": "PSF-2.0", "status": "used"}]
    if with_packages and not smoke:
        for name, folders in PACKAGES:
            info, files = _package(name, folders)
            sources.append(info)
            listing += [(name, base, rel) for base, rel in files]
    if smoke:
        listing, holdout_every = listing[:40], 10
    train, held, sha, total = [], [], hashlib.sha256(), 0
    per_source: dict[str, int] = {}
    for source, base, rel in listing:
        text = (base / rel).read_text(encoding="utf-8", errors="replace")
        taken = per_source.get(source, 0)
        if not _usable(text) or (source != "stdlib" and taken + len(text) > PER_PACKAGE_BYTES):
            continue
        if total + len(text) > max_bytes:
            break
        total += len(text)
        per_source[source] = taken + len(text)
        name = rel.as_posix()
        sha.update(f"{source}/{name}".encode() + b"\0" + text.encode() + b"\0")
        kept = train if (len(train) + len(held)) % holdout_every != holdout_every // 2 \
            else held
        kept.append(SourceFile(source, name, text))
    return Corpus(train, held, sources, sha.hexdigest())


def write(corpus: Corpus, path: Path) -> None:
    """The corpus as gzipped JSON, for training on a machine without these packages."""
    doc = {"train": [asdict(f) for f in corpus.train], "held": [asdict(f) for f in corpus.held],
           "sources": corpus.sources, "sha256": corpus.sha256}
    with gzip.open(path, "wt", encoding="utf-8") as out:
        json.dump(doc, out)


def read(path: Path) -> Corpus:
    """A corpus `write` wrote: the same files, split and hash."""
    with gzip.open(path, "rt", encoding="utf-8") as src:
        doc = json.load(src)
    return Corpus([SourceFile(**f) for f in doc["train"]], [SourceFile(**f) for f in doc["held"]],
                  doc["sources"], doc["sha256"])


# ------------------------------------------------------------------------ chat pairs

@dataclass(frozen=True)
class Function:
    signature: str  # the def line(s), dedented, ending with ":"
    docstring: str  # its first paragraph
    body: str  # the whole function, dedented, docstring removed
    source: str  # the whole function, dedented, as written


def functions(text: str, max_lines: int = 30) -> list[Function]:
    """Top-level functions and methods with a docstring, of at most `max_lines` lines."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.decorator_list or node.end_lineno is None:
            continue
        first = doc.strip().split("\n\n")[0].strip()
        span = node.end_lineno - node.lineno + 1
        if len(first) < 20 or span > max_lines or len(node.body) < 2:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        doc_node = node.body[0]
        body_start = node.body[1].lineno
        sig = textwrap.dedent("\n".join(lines[node.lineno - 1:doc_node.lineno - 1]))
        rest = "\n".join(lines[body_start - 1:node.end_lineno])
        body = sig + "\n" + textwrap.indent(textwrap.dedent(rest), "    ")
        if not sig.rstrip().endswith(":"):
            continue
        found.append(Function(sig.rstrip(), " ".join(first.split()), body, source))
    return found


ASK_CODE = ["{doc}", "Write a Python function. {doc}", "Write a function: {doc}",
            "Implement this in Python: {doc}"]
ASK_DOC = ["What does this function do?\n\n{code}", "Explain this code:\n\n{code}"]


def conversations(files: list[SourceFile], seed: int) -> list[list[dict[str, str]]]:
    """Chat pairs from the code: a docstring asks for its function, or a function asks
    what it does and its docstring answers. Some conversations have two turns."""
    rng = random.Random(seed)
    turns: list[list[dict[str, str]]] = []
    for file in files:
        for fn in functions(file.text):
            if rng.random() < 0.6:
                ask = rng.choice(ASK_CODE).format(doc=fn.docstring)
                turns.append([{"role": "user", "content": ask},
                              {"role": "assistant", "content": fn.source}])
            else:
                ask = rng.choice(ASK_DOC).format(code=fn.body)
                turns.append([{"role": "user", "content": ask},
                              {"role": "assistant", "content": fn.docstring}])
    rng.shuffle(turns)
    chats, i = [], 0
    while i < len(turns):
        if i + 1 < len(turns) and rng.random() < 0.25:
            chats.append(turns[i] + turns[i + 1])
            i += 2
        else:
            chats.append(turns[i])
            i += 1
    return chats
