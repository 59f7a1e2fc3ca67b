"""Building our C++ on first use: one cache folder, names keyed by what the build depends on, atomic writes.

Shared by the CPU kernels (``engine/kernels``: a torch op library) and the native draft core
(``drafters/native``: a pybind11 module), so it sits below both layers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Sequence

import torch


def cache_dir() -> Path:
    """Where built libraries are kept: ``$RACER_KERNEL_CACHE`` or ``~/.cache/racer-batch/kernels``."""
    env = os.environ.get("RACER_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "racer-batch" / "kernels"


def library_path(src: Path, flags: Sequence[str], stem: str) -> Path:
    """``<cache_dir>/<stem>-<hash>.so``: the hash covers the source, the flags and the Python and torch versions
    (torch ships the headers both builds use), so a change of any of them builds anew."""
    key = hashlib.sha256()
    key.update(src.read_bytes())
    key.update(" ".join(flags).encode())
    key.update(torch.__version__.encode())
    key.update(sys.version.encode())
    return cache_dir() / f"{stem}-{key.hexdigest()[:16]}.so"


def compile_library(src: Path, out: Path, flags: Sequence[str], link: Sequence[str] = ()) -> None:
    """Compile ``src`` with the machine's C++ compiler (``$CXX``, else ``c++`` / ``g++``) into ``out``, with
    torch's and Python's include folders; written to a temporary file first and moved into place atomically (a
    concurrent builder sees either no file or a whole one; a failed build leaves none).

    Raises:
        RuntimeError: no compiler, or the build failed (the message carries the compiler's stderr tail).
    """
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, *includes, str(src), "-o", tmp, *link], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {src.name} with {cxx} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
