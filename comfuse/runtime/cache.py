"""On-disk cache of generated kernel sources.

Files are named by a key that hashes everything that changes the source (the
region's structure, the plan's parameters, the code generator's version).
Writes go to a temporary file first and are then renamed over the target, so
concurrent writers (several ranks, several processes) never leave a torn file.
"""
from __future__ import annotations

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


def kernel_dir() -> Path:
    return settings.get().cache_dir / "kernels"


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
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


def clear() -> int:
    """Delete cached sources; return how many files went."""
    count = 0
    d = kernel_dir()
    if d.exists():
        for f in d.glob("*.py"):
            f.unlink()
            count += 1
    _loaded.clear()
    return count
