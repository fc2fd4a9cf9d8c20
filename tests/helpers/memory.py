"""Host memory a call takes, as Python's tracemalloc sees it (NumPy reports its array buffers
to tracemalloc; torch's own allocations it does not)."""
from __future__ import annotations

import tracemalloc


def peak_traced_bytes(call):
    """Run ``call()`` under tracemalloc; return (the peak traced bytes during it, its result).
    The CPU backend's memory of earlier calls' large arrays is forgotten first (as in
    :func:`held_bytes`): every array the call makes counts."""
    _forget_recycled()
    tracemalloc.start()
    try:
        result = call()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


_profiler_started = []


def _forget_recycled():
    """Forget what the CPU backend keeps in this thread (lltm_cupy._numpy.memory.forget), its
    earlier arrays that it would reuse among it."""
    from lltm_cupy._numpy import memory

    memory.forget()


def held_bytes(call):
    """Run ``call()``; return (the bytes it allocated and still holds when it returns, its
    result): NumPy's buffers as tracemalloc sees them plus torch's CPU allocations as torch's
    profiler records them (each sees only its own, so the sum counts everything once). The CPU
    backend's memory of earlier calls' large arrays is forgotten first, so that every array
    the call keeps is one it allocates (not one reused, which tracemalloc saw before)."""
    import torch

    def profile():
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      profile_memory=True)

    _forget_recycled()
    if not _profiler_started:       # its first start allocates for good: not the call's bytes
        with profile():
            _profiler_started.append(True)
    tracemalloc.start()
    try:
        with profile() as prof:
            result = call()
        numpy_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return numpy_bytes + sum(e.self_cpu_memory_usage for e in prof.events()), result
