"""Fault injection, as SQLite tests its out-of-memory handling (sqlite.org/testing.html,
"anomaly testing"): run an operation once from a fixed state and count the injection points it
passes; then, for k = 1 .. N, run it again from the same state with a failure at the k-th point
alone, and check what that left:

- the call raised a clear error (the failure injected, itself or as the cause of what it raised)
  or took its documented fallback (then its results agree with the run that never faulted, to
  the fallback's rounding);
- the next call without a fault returns bit for bit what the run that never faulted returned;
- no cache holds a half-built entry (every cache entry left behind is one the run that never
  faulted makes, the same in every part; after the next call, the caches are exactly that run's);
- no memory is left allocated (every allocation the two calls made and that is still alive
  belongs to a cache entry);
- the current device, the current streams, the allocator and the other per-thread settings are
  what they were.

The injection points, each a kind (``Injector.points``):

    alloc:cupy          an allocation from the pool of the emulated CuPy
                        (tests/helpers/emulated_cupy.py)
    alloc:torch         a new storage of a torch operator (:class:`TorchAllocations`, a
                        TorchDispatchMode: every allocation of torch's, the CuPy allocator that
                        the torch layer installs included)
    compile             a kernel compile and module load: our modules and CuPy's own kernels
    launch              a kernel launch (element-wise and one-block fused kernels)
    launch:cluster      a launch of the cluster kernels: failed, or refused (the driver's
                        CUDA_ERROR_INVALID_CLUSTER_SIZE)
    launch:cooperative  a launch of the group kernels: failed, or refused (the driver's
                        CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)
    occupancy           the driver's occupancy query of a cluster (answers an error status)
    occupancy:group     the driver's occupancy query of a cooperative kernel (raises)
    gemm:cublas         a cuBLAS GEMM through CuPy's binding
    gemm:torch          a torch GEMM of the CUDA path
    alloc:mmap          a mapping of the NumPy backend's scratch and workspaces (MemoryError)
    step                the GEMM that starts a step of a CPU sequence loop (KeyboardInterrupt:
                        between two steps)

and, counted apart by a NumPy data-memory handler (tests/helpers/numpy_faults.cpp), every
buffer NumPy allocates (MemoryError, NumPy's own).
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PACKAGE = str(Path(__file__).resolve().parents[2] / "lltm_cupy")


def _site() -> tuple:
    """The library's frames on the stack here (file, line), innermost first: where a point is."""
    frame, found = sys._getframe(2), []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            found.append((name[len(PACKAGE) + 1:], frame.f_lineno))
        frame = frame.f_back
    return tuple(found)


class Injector:
    """The hook every injection point calls with its kind: counts the points while
    :attr:`counting`, and at the point :attr:`target` (index, variant) returns the failure
    ``failures[kind][variant]()`` makes (remembered in :attr:`made`), else None."""

    def __init__(self, failures: dict):
        self.failures = failures
        self.points: list = []
        self.sites: list = []
        self.counting = False
        self.target = None
        self.made = None
        self.made_kind = None
        #: record each point's site (the run without a fault needs them; a stack walk a point)
        self.record_sites = True

    def __call__(self, kind: str, detail=None):
        if not self.counting:
            return None
        index = len(self.points)
        self.points.append(kind)
        if self.record_sites:
            self.sites.append(_site() + ((detail, 0),) if detail else _site())
        if self.target is not None and index == self.target[0]:
            self.made = self.failures[kind][self.target[1]]()
            self.made_kind = kind
            return self.made
        return None

    def start(self, target=None):
        self.points, self.sites = [], []
        self.target, self.made, self.made_kind = target, None, None
        self.counting = True

    def stop(self):
        self.counting = False


def _tensors(obj, found):
    import torch

    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, found)
    return found


def torch_allocations(injector: Injector):
    """A TorchDispatchMode whose every new storage (an operator's output whose memory is none of
    its inputs') is an "alloc:torch" point of ``injector``, failed with the failure it makes
    (the operator has run: its result is dropped, as if the allocation had failed), and kept
    track of (:attr:`made`: weak references to the storages, their pointers and sizes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class TorchAllocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not injector.counting:
                return func(*args, **kwargs)
            before = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs), [])
                      if not t.is_mkldnn}
            out = func(*args, **kwargs)
            seen = set()
            for t in _tensors(out, []):
                if t.is_mkldnn:     # (oneDNN's packed weights: no storage, always new)
                    failure = injector("alloc:torch", str(func))
                    if failure is not None:
                        del out, t
                        raise failure
                    self.made.append((weakref.ref(t), id(t), t.numel() * t.element_size()))
                    continue
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if not storage.nbytes() or ptr in before or ptr in seen:
                    continue
                seen.add(ptr)
                failure = injector("alloc:torch", str(func))
                if failure is not None:
                    del out, t, storage
                    raise failure
                self.made.append((weakref.ref(storage), ptr, storage.nbytes()))
            return out

        def alive(self) -> dict:
            """{pointer: bytes} of the storages made under the mode that are still alive."""
            return {ptr: n for ref, ptr, n in self.made if ref() is not None}

    return TorchAllocations()


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def signature(value):
    """A comparable picture of a cache entry: its structure, types, and plain values."""
    if isinstance(value, dict):
        return {k: signature(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (type(value).__name__, tuple(signature(v) for v in value))
    if isinstance(value, (tuple, list)):
        return tuple(signature(v) for v in value)
    if isinstance(value, (int, float, str, bool, type(None), np.integer, np.floating)):
        return value
    return type(value).__name__


@dataclass
class Report:
    """What :func:`explore` found: the points of the run without a fault by kind, the faults
    injected, and every problem seen (an empty list: none)."""

    name: str
    points: dict = field(default_factory=dict)
    sites: int = 0
    injected: int = 0
    raised: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    def line(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.points.items()))
        return (f"{self.name}: {sum(self.points.values())} points ({kinds}); {self.injected} "
                f"faults injected: raised {sum(self.raised.values())}, fallback "
                f"{sum(self.fallbacks.values())}")


def _host(v):
    """A host copy of a result (a torch tensor, an emulated CuPy or a NumPy array)."""
    if hasattr(v, "detach"):
        return v.detach().cpu().numpy().copy()
    return np.array(np.asarray(v))


def _chain(error):
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


class Bench:
    """What one path (the emulated CUDA path, the CPU) gives :func:`explore`; subclasses fill
    in every method."""

    injector: Injector
    #: (kind -> variants) whose failure is a status the library answers by a fallback (it must
    #: not raise)
    status_kinds: tuple = ()

    def cold(self, variant_state=None) -> None:
        """Every cache of the library as at a process's first call."""
        raise NotImplementedError

    def caches(self) -> dict:
        raise NotImplementedError

    def context(self) -> tuple:
        raise NotImplementedError

    def run_op(self, op):
        """``op()`` with what counts the points installed."""
        return op()

    def drop(self) -> None:
        """Forget what a run left with the caller (the parameters' gradients)."""

    def begin(self) -> None:
        """Start of a run: what memory exists before it."""

    def leaks(self) -> list:
        """The allocations made since :meth:`begin` that are alive and no cache's."""
        return []

    def lasting(self):
        """The state a failure may change for good as documented (the refused cluster sizes):
        a run that never faulted from that state is the reference of the next call."""
        return None

    def documented(self, made) -> bool:
        """Whether a call that returned after the failure ``made`` took a documented fallback
        (a status answered by planning without it; a refusal recorded as such)."""
        return not isinstance(made, BaseException) and not hasattr(made, "error")


def _merge(pictures) -> dict:
    """The caches of several runs without a fault as one: name -> {key: [signatures]}."""
    merged = {}
    for picture in pictures:
        for name, entries in picture.items():
            into = merged.setdefault(name, {})
            for key, sig in entries.items():
                if sig not in into.setdefault(key, []):
                    into[key].append(sig)
    return merged


def _outside(picture: dict, merged: dict) -> list:
    """The entries of ``picture`` that no run without a fault makes as they are."""
    bad = []
    for name, entries in picture.items():
        for key, sig in entries.items():
            known = merged.get(name, {}).get(key)
            if known is None:
                bad.append(f"{name}[{key!r}]: not made by a run without a fault")
            elif sig not in known:
                bad.append(f"{name}[{key!r}]: {sig!r}, a run without a fault makes "
                           f"{' or '.join(map(repr, known))}")
    return bad


def _raised_at(error) -> str:
    """Where ``error`` was raised: its innermost frame in the library (or the last one)."""
    tb, found = error.__traceback__, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith(PACKAGE) or found is None:
            found = f"{Path(name).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found or "?"


def explore(bench: Bench, name: str, op, *, close=None, dedupe=False, kinds=None,
            variants=None, also=()) -> Report:
    """Inject a failure at each point of ``op()`` in turn (see the module docstring); returns a
    :class:`Report`. ``op()`` returns {name: array-like} (copied to the host here, after the
    run); ``close(got, want)`` -> a problem string or None: the check of a fallback's results
    (default: the same bits). ``dedupe``: one fault per distinct site (kind and the library's
    stack) rather than per point; "innermost": per kind and innermost library frame. ``kinds``:
    only points of these kinds. ``variants``: kind -> the failures to inject there (default:
    every one the injector knows). ``also``: the
    operations of the fallback paths (a fused call's stepped path): the cache entries their runs
    make may be left by a fallback too."""
    inj = bench.injector
    report = Report(name)
    references = {}

    def run(target=None, fn=op):
        bench.begin()
        inj.start(target)
        error = found = None
        try:
            found = bench.run_op(fn)
        except BaseException as exc:    # noqa: BLE001 (KeyboardInterrupt is injected too)
            error = exc
            where = _raised_at(exc)
            # (the traceback's first frame is this one, which holds the error: a cycle that
            # would keep every frame of the call, and their arrays, until a garbage collection)
            exc.__traceback__ = None
            error.raised_at = where
        finally:
            inj.stop()
        results = None if found is None else {k: _host(v) for k, v in found.items()
                                              if v is not None}
        del found
        bench.drop()
        return results, error

    def clean_run(state, fn=op):
        bench.cold(state)
        results, error = run(fn=fn)
        if error is not None:
            raise AssertionError(f"{name}: a run without a fault raised "
                                 f"{type(error).__name__} at {error.raised_at}: {error}")
        return results, bench.caches()

    def reference(state):
        key = repr(state)
        if key not in references:
            references[key] = clean_run(state)
        return references[key]

    bench.cold()
    inj.record_sites = True
    want, error = run()
    inj.record_sites = False
    if error is not None:
        raise AssertionError(f"{name}: the run without a fault raised {type(error).__name__} "
                             f"at {error.raised_at}: {error}")
    points, sites = list(inj.points), list(inj.sites)
    if hasattr(inj, "freeze"):
        inj.freeze()
    references[repr(bench.lasting())] = (want, bench.caches())
    extra = [clean_run(None, fn)[1] for fn in also]
    report.points = {k: points.count(k) for k in dict.fromkeys(points)}
    report.sites = len(set(zip(points, sites)))
    targets, seen = [], set()
    for i, (kind, site) in enumerate(zip(points, sites)):
        if kinds is not None and kind not in kinds:
            continue
        if dedupe:
            key = (kind, site[:1] if dedupe == "innermost" else site)
            if key in seen:
                continue
            seen.add(key)
        for variant in (variants or {}).get(kind, inj.failures[kind]):
            targets.append((i, variant))
    problems = report.problems
    for i, variant in targets:
        where = f"{name}: {variant} {points[i]} at point {i + 1} of {len(points)} " \
                f"({' < '.join(f'{f}:{n}' for f, n in sites[i][:4])})"
        bench.cold()
        before = bench.context()
        got, error = run((i, variant))
        report.injected += 1
        made = inj.made
        if made is None:
            problems.append(f"{where}: the point was not reached again")
            continue
        if error is not None:
            report.raised[points[i]] = report.raised.get(points[i], 0) + 1
            said = f"{type(error).__name__} at {error.raised_at}: {error}"
            if isinstance(made, BaseException):
                if made not in _chain(error):
                    problems.append(f"{where}: raised {said} (not the failure injected)")
            elif hasattr(made, "error"):     # a failure the library below raises for us
                if not any(isinstance(e, made.error) for e in _chain(error)):
                    problems.append(f"{where}: raised {said} (not a {made.error.__name__})")
            else:
                problems.append(f"{where}: a status the library answers by a fallback raised "
                                f"{said}")
        else:
            report.fallbacks[points[i]] = report.fallbacks.get(points[i], 0) + 1
            if not bench.documented(made):
                problems.append(f"{where}: the failure injected vanished (no error, and no "
                                f"documented fallback)")
            for key, value in want.items():
                if key not in got:
                    problems.append(f"{where}: the fallback returned no {key}")
                    continue
                bad = close(got[key], value) if close else (
                    None if same_bits(got[key], value) else "not the same bits")
                if bad:
                    problems.append(f"{where}: the fallback's {key}: {bad}")
        # (the failure holds the frames of the call: drop it before looking for memory left
        # allocated)
        del error, got, made
        inj.made = None
        after = bench.context()
        if after != before:
            problems.append(f"{where}: left the context {after}, it was {before}")
        faulted = bench.caches()
        for bad in bench.leaks():
            problems.append(f"{where}: left allocated: {bad}")
        state = bench.lasting()
        got, error = run()          # the next call, without a fault
        recovered, leaks, after = bench.caches(), bench.leaks(), bench.context()
        want_next, caches_next = reference(state)
        merged = _merge([c for _, c in references.values()] + extra)
        for bad in _outside(faulted, merged):
            problems.append(f"{where}: a cache holds {bad}")
        if error is not None:
            problems.append(f"{where}: the next call raised {type(error).__name__} at "
                            f"{error.raised_at}: {error}")
            continue
        for key, value in want_next.items():
            if key not in got or not same_bits(got[key], value):
                problems.append(f"{where}: the next call's {key} is not the bits of a run "
                                f"without a fault")
        for bad in _outside(recovered, merged):
            problems.append(f"{where}: after the next call, {bad}")
        for cache, entries in caches_next.items():
            for key in entries:
                if key not in recovered.get(cache, {}):
                    problems.append(f"{where}: after the next call, {cache}[{key!r}] is "
                                    f"missing (a run without a fault makes it)")
        for bad in leaks:
            problems.append(f"{where}: after the next call, left allocated: {bad}")
        if after != before:
            problems.append(f"{where}: the next call left the context {after}")
    return report
