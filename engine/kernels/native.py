"""The engine's C kernels for the CPU: compiled on first use with the system C compiler into the
cache directory (one file per source and flags), then loaded with ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


class KernelUnavailable(RuntimeError):
    pass


def load(source: Path, cache_dir: Path, cflags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built from `source` with `cflags` (built now if the cache has none)."""
    text = source.read_bytes()
    tag = hashlib.sha256(text + " ".join(cflags).encode()).hexdigest()[:12]
    lib_path = Path(cache_dir) / "kernels" / f"{source.stem}-{tag}.so"
    if not lib_path.exists():
        _compile(source, cflags, lib_path)
    return ctypes.CDLL(str(lib_path))


def _compile(source: Path, cflags: tuple[str, ...], lib_path: Path) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *cflags, "-o", tmp, str(source)], capture_output=True, text=True)
    except FileNotFoundError as e:
        os.unlink(tmp)
        raise KernelUnavailable(f"no C compiler ({cc}) to build the CPU kernel {source.name}") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise KernelUnavailable(f"building the CPU kernel {source.name} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file
