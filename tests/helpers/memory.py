"""Host memory a call takes, as Python's tracemalloc sees it (NumPy reports its array buffers
to tracemalloc; torch's own allocations it does not)."""
from __future__ import annotations

import tracemalloc


def peak_traced_bytes(call):
    """Run ``call()`` under tracemalloc; return (the peak traced bytes during it, its result)."""
    tracemalloc.start()
    try:
        result = call()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()
