"""Python calls counted with ``sys.setprofile``: the host work of the library measured without a
clock (deterministic, so a budget can be a test).

:func:`counted` runs a callable and returns a :class:`Calls`:

- ``library``: calls of functions defined in ``lltm_cupy/`` (Python functions and methods;
  a generator's every resumption counts, as ``sys.setprofile`` reports it);
- ``cupy``: calls made by ``lltm_cupy`` code into CuPy (the real one's compiled functions and
  methods, or the tests' emulated CuPy, tests/helpers/emulated_cupy.py, whose functions are
  Python): what a CuPy call costs on a GPU host is host time the library spends.

Calls into torch, NumPy and the standard library are not counted there: they are the work
itself (or the price of the language), the same for any implementation of the layer.

:func:`counted_numpy` counts them too, for the CPU backend's budgets: every call that
``lltm_cupy`` code makes of a NumPy function or ufunc (``sys.setprofile`` sees no ufunc call:
while it runs, the ``np`` of every loaded ``lltm_cupy`` module is a stand-in whose callables
count their calls, and the backend's cached step functions, which bind ufuncs once, are made
again under it), of a method of an array or ufunc (a view, a reduction), and of a torch
function or method, with the library's own Python calls as :func:`counted` counts them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import lltm_cupy

PACKAGE = str(Path(lltm_cupy.__file__).resolve().parent)
EMULATED = str(Path(__file__).resolve().parent / "emulated_cupy.py")


@dataclass
class Calls:
    library: int = 0
    cupy: int = 0
    names: dict = field(default_factory=dict)    # "file:function" -> calls (library only)

    @property
    def total(self) -> int:
        return self.library + self.cupy

    def __str__(self) -> str:
        top = sorted(self.names.items(), key=lambda kv: -kv[1])
        return (f"{self.library} library + {self.cupy} CuPy calls: "
                + ", ".join(f"{n} x{c}" for n, c in top))


def _in_package(code) -> bool:
    return code.co_filename.startswith(PACKAGE)


def _is_cupy_builtin(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    if not module:
        owner = getattr(fn, "__self__", None)
        module = type(owner).__module__ if owner is not None else ""
    return module == "cupy" or module.startswith(("cupy.", "cupy_backends", "cupyx"))


def counted(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), Calls)``."""
    calls = Calls()
    names = calls.names

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if _in_package(code):
                calls.library += 1
                key = f"{Path(code.co_filename).name}:{code.co_name}"
                names[key] = names.get(key, 0) + 1
            elif code.co_filename == EMULATED or "/cupy/" in code.co_filename:
                caller = frame.f_back
                if caller is not None and _in_package(caller.f_code):
                    calls.cupy += 1
        elif event == "c_call":
            if _in_package(frame.f_code) and _is_cupy_builtin(arg):
                calls.cupy += 1

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return result, calls



@dataclass
class NumpyCalls:
    numpy: int = 0          # NumPy functions and ufuncs, and methods of arrays and ufuncs
    torch: int = 0          # torch functions and methods
    library: int = 0        # Python functions of lltm_cupy
    names: dict = field(default_factory=dict)    # NumPy's: name -> calls
    torch_names: dict = field(default_factory=dict)

    def __str__(self) -> str:
        top = sorted(self.names.items(), key=lambda kv: -kv[1])
        return (f"{self.numpy} NumPy + {self.torch} torch + {self.library} library calls: "
                + ", ".join(f"{n} x{c}" for n, c in top))


class _Counted:
    """A NumPy callable whose calls are counted (attributes, e.g. a ufunc's ``reduce``, are the
    real one's)."""

    __slots__ = ("_real", "_name", "_calls")

    def __init__(self, real, name, calls):
        self._real, self._name, self._calls = real, name, calls

    def __call__(self, *args, **kwargs):
        calls = self._calls
        calls.numpy += 1
        calls.names[self._name] = calls.names.get(self._name, 0) + 1
        return self._real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


class _CountingNumpy:
    """The ``numpy`` module as lltm_cupy's modules see it while counting: its callables
    (functions, ufuncs; not types such as ``np.ndarray`` or ``np.float32``) counted."""

    def __init__(self, real, calls):
        self._real, self._calls = real, calls

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if callable(value) and not isinstance(value, type):
            return _Counted(value, name, self._calls)
        return value


def _owner_module(fn) -> str:
    owner = getattr(fn, "__self__", None)
    module = getattr(fn, "__module__", None) or ""
    if owner is not None and not isinstance(owner, type(sys)):
        module = type(owner).__module__ or module
    return module


def _forget_cached_steps() -> None:
    """Drop what the CPU backend keeps per thread (lltm_cupy._numpy.memory.forget), its step
    functions among it, which bind NumPy's callables when made."""
    memory = sys.modules.get("lltm_cupy._numpy.memory")
    if memory is not None:
        memory.forget()


def counted_numpy(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), NumpyCalls)`` (see the module docstring): ``fn`` runs twice
    under the stand-in, and the second call is counted (the first makes what the backend makes
    once per thread and shape)."""
    import numpy

    counting = NumpyCalls()
    stand_in = _CountingNumpy(numpy, counting)
    patched = [m for n, m in list(sys.modules.items())
               if n.startswith("lltm_cupy") and getattr(m, "np", None) is numpy]

    calls = counting

    def profile(frame, event, arg):
        if event == "call":
            if _in_package(frame.f_code):
                calls.library += 1
        elif event == "c_call" and _in_package(frame.f_code):
            module = _owner_module(arg)
            if module.startswith("numpy"):
                calls.numpy += 1
                name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")
                calls.names[name] = calls.names.get(name, 0) + 1
            elif module.startswith("torch"):
                calls.torch += 1
                name = getattr(arg, "__name__", "?")
                calls.torch_names[name] = calls.torch_names.get(name, 0) + 1

    for m in patched:
        m.np = stand_in
    _forget_cached_steps()
    old = sys.getprofile()
    try:
        fn(*args, **kwargs)
        counting.numpy = counting.torch = counting.library = 0
        counting.names.clear()
        counting.torch_names.clear()
        sys.setprofile(profile)
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
        for m in patched:
            m.np = numpy
        _forget_cached_steps()
    return result, calls
