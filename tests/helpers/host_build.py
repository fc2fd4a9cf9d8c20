"""g++ builds of the CUDA sources as host C++ (a harness of tests/host_shim, which includes
cuda_src's files), shared by every test of a run that needs the same build, in every process.

A build is made once per run and key: the SHA-256 of the compiler (its path and ``--version``),
the flags, the harness's name, the content of every file of tests/host_shim and cuda_src, and
the replacement sources (mutation tests). :func:`configure` (tests/conftest.py, once per
process) names the run's cache folder, one for all of pytest-xdist's workers. The first process
to need a build takes the key's lock (``fcntl.flock``, so a second worker waits instead of
compiling the same again), compiles into a folder of its own and moves the library into place
with ``os.replace`` (atomic: another process sees the whole file or none). Each caller loads a
copy of its own (:func:`load`): a library that ctypes loads from one path is one instance, with
one set of the shim's globals (the schedule, the last error), which two fixtures must not share.

Without :func:`configure` (a helper used outside pytest) every build compiles into the caller's
folder, as before the cache.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lltm_cupy._cuda import kernels as _kernels

SHIM = Path(__file__).resolve().parents[1] / "host_shim"
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")

_cache: Path | None = None
#: builds this process compiled or found: key -> "compiled" / "found" (tests of the cache)
events: dict = {}


def configure(folder: Path | None) -> None:
    """Use ``folder`` (created if missing) as the run's build cache; None: no cache."""
    global _cache
    _cache = None if folder is None else Path(folder)
    if _cache is not None:
        _cache.mkdir(parents=True, exist_ok=True)


def cache_folder() -> Path | None:
    return _cache


@functools.lru_cache(maxsize=None)
def _compiler() -> tuple:
    cxx = shutil.which("g++")
    assert cxx, "g++ is required to run the CUDA source on the CPU (apt-get install g++)"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return cxx, version


def _inputs() -> list:
    """Every file a harness may include: tests/host_shim's and cuda_src's."""
    cuda_src = _kernels.source_path().parent
    return sorted([*SHIM.iterdir(), *cuda_src.glob("*.cu")], key=lambda p: (str(p.parent),
                                                                               p.name))


def key(harness: str, sources: dict | None = None) -> str:
    """The cache key of ``harness`` built with ``sources`` ({file name: text}, replacing the
    files of cuda_src of those names) in place of cuda_src's."""
    cxx, version = _compiler()
    digest = hashlib.sha256()
    for part in (cxx, version, " ".join(FLAGS), harness):
        digest.update(part.encode() + b"\0")
    for path in _inputs():
        if path.is_file():
            digest.update(f"{path.parent.name}/{path.name}".encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    for name, text in sorted((sources or {}).items()):
        digest.update(f"replaced/{name}".encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


def _compile(harness: str, sources: dict | None, out: Path) -> None:
    """g++ ``harness`` into ``out``; ``sources`` written next to ``out`` first on the path."""
    cxx, _ = _compiler()
    includes = []
    if sources:
        folder = out.parent / "replaced"
        folder.mkdir(exist_ok=True)
        for name, text in sources.items():
            (folder / name).write_text(text)
        includes.append(f"-I{folder}")
    includes += [f"-I{_kernels.source_path().parent}", f"-I{SHIM}"]
    cmd = [cxx, *FLAGS, *includes, str(SHIM / harness), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"host build failed: {' '.join(cmd)}\n{proc.stderr}"


def built(harness: str, sources: dict | None = None, scratch: Path | None = None) -> Path:
    """The shared library of ``harness`` (with ``sources`` replacing cuda_src's files of those
    names): from the run's cache, compiled there first if no process has yet; without a cache,
    compiled into ``scratch``."""
    if _cache is None:
        assert scratch is not None, "no build cache configured: give a folder to build in"
        work = Path(tempfile.mkdtemp(prefix="build-", dir=scratch))
        out = work / (Path(harness).stem + ".so")
        _compile(harness, sources, out)
        return out
    k = key(harness, sources)
    final = _cache / f"{Path(harness).stem}-{k[:24]}.so"
    if final.exists():
        events[k] = "found"
        return final
    with open(_cache / f"{Path(harness).stem}-{k[:24]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.exists():          # another process built it while this one waited
                events[k] = "found"
                return final
            with tempfile.TemporaryDirectory(prefix="build-", dir=_cache) as work:
                out = Path(work) / final.name
                _compile(harness, sources, out)
                os.replace(out, final)
            events[k] = "compiled"
            return final
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(library: Path, into: Path, name: str) -> ctypes.CDLL:
    """A copy of ``library`` at ``into/name``, loaded: an instance of its own (ctypes loads a
    path once per process: two loads of one file would share the shim's globals)."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    target = into / name
    if target.exists():     # the same folder used again: a fresh name, a fresh instance
        target = Path(tempfile.mkdtemp(prefix="lib-", dir=into)) / name
    shutil.copyfile(library, target)
    return ctypes.CDLL(str(target))


def build(harness: str, into: Path, name: str, source_dir: Path | None = None,
          sources: dict | None = None) -> ctypes.CDLL:
    """``harness`` built (or found in the run's cache) and loaded from a copy at ``into/name``.
    ``source_dir``: a folder whose .cu files replace cuda_src's of the same names (as a
    mutation test writes them); ``sources``: the same as {file name: text}."""
    replaced = dict(sources or {})
    if source_dir is not None:
        for path in sorted(Path(source_dir).glob("*.cu")):
            replaced.setdefault(path.name, path.read_text())
    return load(built(harness, replaced or None, scratch=Path(into)), into, name)
