"""On-disk cache of generated kernel sources.

Files are named by a key that hashes everything that changes the source (the
region's structure, the plan's parameters, the code generator's version).
Writes go to a temporary file first and are then renamed over the target, so
concurrent writers (several ranks, several processes) never leave a torn file.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path

from .. import settings

CODEGEN_VERSION = "triton-23"  # bumped when generated code or launch cost changes: stored tuning decisions are re-measured
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@functools.cache
def source_digest() -> str:
    """A digest of comfuse's own source files: what a stored region (pickled objects of
    comfuse's classes) and Inductor's graphs compiled with comfuse's pass are valid for."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def kernel_dir() -> Path:
    return settings.get().cache_dir / "kernels"


def atomic_write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_source(name: str, text: str):
    """Write ``text`` to the cache as ``name``.py (unless already there) and import it."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        path = kernel_dir() / f"{name}.py"
        if not path.exists() or path.read_bytes() != text.encode():  # (a damaged file is rewritten)
            atomic_write(path, text)
        spec = importlib.util.spec_from_file_location(f"comfuse_kernels.{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # Triton's JIT reads the source through inspect
        spec.loader.exec_module(module)
        _loaded[name] = module
        return module


GENERATION_FILE = "generation"  # a token naming this cache's contents (``generation``)


def generation() -> str:
    """A random token written once into the cache directory and read back after: it names
    what this cache holds. Inductor's own on-disk caches key the graphs compiled with comfuse's
    pass by it (inductor_pass.RegionPass.uuid), so a graph built from decisions that are gone
    (the cache cleared or another COMFUSE_CACHE_DIR) is not reused."""
    path = settings.get().cache_dir / GENERATION_FILE
    try:
        token = path.read_text().strip()
        if token:
            return token
    except OSError:
        pass
    atomic_write(path, os.urandom(8).hex())
    return path.read_text().strip()  # (another process may have written its token first)


# what the cache directory holds: (folder, its files, what they are)
CONTENTS = (("kernels", "*.py", "kernel sources"), ("tuning", "*.json", "autotuning decisions"),
            ("measured", "*.json", "records of measured plans"), ("verdicts", "*.json", "graph verdicts"),
            ("regions", "*.pt", "fused regions of Inductor's cached graphs"))


def _files(sub: str) -> list:
    pattern = next(pattern for name, pattern, _ in CONTENTS if name == sub)
    d = settings.get().cache_dir / sub
    return list(d.glob(pattern)) if d.exists() else []


def counts() -> dict:
    """What the cache holds: description -> how many files."""
    return {what: len(_files(sub)) for sub, _, what in CONTENTS}


def _remove(sub: str) -> int:
    files = _files(sub)
    for f in files:
        f.unlink(missing_ok=True)
    return len(files)


def new_generation() -> int:
    """Forget the graphs' verdicts and start a new generation: Inductor's cached graphs built
    with comfuse's pass are not reused, and every graph is lowered and decided afresh (the
    kernels and the regions' decisions stay). Returns how many verdicts went."""
    count = _remove("verdicts")
    (settings.get().cache_dir / GENERATION_FILE).unlink(missing_ok=True)
    return count


def clear() -> int:
    """Delete every file of ``CONTENTS`` (kernel sources, autotuning decisions, the GPU's
    record of measured plans, the graphs' verdicts, the stored regions) and start a new
    generation (``new_generation``); return how many files went."""
    count = _remove("kernels") + _remove("tuning") + _remove("measured") + _remove("regions") + new_generation()
    _loaded.clear()
    return count
