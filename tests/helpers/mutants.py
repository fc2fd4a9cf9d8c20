"""Mutation tests of the kernels' synchronisation: each barrier (or part of one) deleted from the
CUDA source in turn, and the host run must catch it. Every mutant of a harness is in one build.

A family is a list of statements of one file of cuda_src (the barriers the cluster kernels pass,
those of the group kernels, the parts of the group barrier, the barriers of the one-block and the
tensor-core kernels). :func:`sources` writes every statement of every family of a harness as

    { if (lltm_host_mutant != K) statement; }

(``lltm_host_mutant``: a global of tests/host_shim/shim.h, -1 when loaded), on the statement's
own line, so that one build holds every mutant: :func:`delete` sets the switch of a loaded copy
to statement K, which then runs as if deleted from the source (the statement is skipped, its
arguments unevaluated, as with the text gone), and every other statement as written. The
tests build it through tests/helpers/host_build.py, once per run: a g++ run of several seconds
for all the mutants of a harness instead of one per mutant.
"""
from __future__ import annotations

import ctypes
import re

from lltm_cupy._cuda import kernels as _kernels

SWITCH = "lltm_host_mutant"
CLUSTER_SOURCE = "lltm_fused_cluster.cu"


def _span(text: str, head: str, close: str = "\n};\n") -> tuple:
    start = text.index(head)
    return start, text.index(close, start)


def group_sync_body(text: str) -> tuple:
    """(start, end) of lltm_group_sync's definition (the group variant's barrier)."""
    return _span(text, "void lltm_group_sync(", "\n}\n")


_CLUSTER_BARRIER = re.compile(r"(lltm_cluster_sync|__syncthreads)\(\);")


def cluster_barriers(text: str) -> list:
    """The barriers the cluster kernels pass (not those of the group variant's exchange, nor
    those inside its barrier lltm_group_sync)."""
    skip = [group_sync_body(text), _span(text, "struct lltm_group_exchange {")]
    return [(m.start(), m.end()) for m in _CLUSTER_BARRIER.finditer(text)
            if not any(a <= m.start() < b for a, b in skip)]


_GROUP_STATEMENT = re.compile(r"(lltm_group_sync\([^;]*\)|__syncthreads\(\));")


def group_barriers(text: str) -> list:
    """(start, end) of every barrier the group kernels pass: those of lltm_group_exchange and the
    block barriers of the kernels' bodies (not those of lltm_cluster_exchange, nor those inside
    lltm_group_sync, which :func:`group_sync_parts` deletes on their own)."""
    cluster = _span(text, "struct lltm_cluster_exchange {")
    sync = group_sync_body(text)
    body = text.index("struct lltm_cluster_exchange {")
    return [(m.start(), m.end()) for m in _GROUP_STATEMENT.finditer(text)
            if m.start() > body and not cluster[0] <= m.start() < cluster[1]
            and not sync[0] <= m.start() < sync[1]]


#: the statements of lltm_group_sync, by name: the statement, "#n" for its n-th occurrence
GROUP_SYNC_PARTS = {
    "first block barrier": "__syncthreads();",
    "release fence": "lltm_group_fence();",
    "arrival": "lltm_group_arrive(counter);",
    "acquire fence": "lltm_group_fence();#2",
    "second block barrier": "__syncthreads();#2",
}


def group_sync_parts(text: str) -> list:
    """(start, end) of each statement of lltm_group_sync, in the order of GROUP_SYNC_PARTS."""
    start, end = group_sync_body(text)
    body = text[start:end]
    spans = []
    for part in GROUP_SYNC_PARTS.values():
        statement, _, nth = part.partition("#")
        at = -1
        for _ in range(int(nth or 1)):
            at = body.index(statement, at + 1)
        spans.append((start + at, start + at + len(statement)))
    return spans


def block_barriers(text: str) -> list:
    """(start, end) of every __syncthreads() of a one-block kernel file."""
    return [(m.start(), m.end()) for m in re.finditer(r"__syncthreads\(\);", text)]


#: family -> (harness, file of cuda_src, its statements under test)
FAMILIES = {
    "cluster": ("harness_cluster.cpp", CLUSTER_SOURCE, cluster_barriers),
    "group": ("harness_cluster.cpp", CLUSTER_SOURCE, group_barriers),
    "group sync": ("harness_cluster.cpp", CLUSTER_SOURCE, group_sync_parts),
    "fused": ("harness_fused.cpp", "lltm_fused.cu", block_barriers),
    "mma": ("harness_fused.cpp", "lltm_fused_mma.cu", block_barriers),
}


def text(source: str) -> str:
    return _kernels.source_path(source).read_text()


def statements(family: str) -> list:
    """(start, end) of the family's statements in today's source."""
    _, source, find = FAMILIES[family]
    return find(text(source))


def _numbering(harness: str) -> dict:
    """{file: sorted (start, end) of every statement some family of ``harness`` deletes}: a
    statement two families share (the backward body's block barrier, passed by the cluster and
    the group kernels alike) is one mutant."""
    spans = {}
    for h, source, find in FAMILIES.values():
        if h == harness:
            spans.setdefault(source, set()).update(find(text(source)))
    return {source: sorted(found) for source, found in sorted(spans.items())}


def sources(harness: str) -> dict:
    """{file: text} of ``harness``'s mutated files: every statement behind the switch."""
    out, number = {}, 0
    for source, spans in _numbering(harness).items():
        original, parts, at = text(source), [], 0
        for start, end in spans:
            assert "\n" not in original[start:end], original[start:end]
            parts += [original[at:start],
                      f"{{ if ({SWITCH} != {number}) {original[start:end]} }}"]
            at, number = end, number + 1
        out[source] = "".join(parts) + original[at:]
    return out


def number(family: str, which: int) -> int:
    """The switch's value that deletes statement ``which`` of ``family``."""
    harness, source, _ = FAMILIES[family]
    base = 0
    for s, spans in _numbering(harness).items():
        if s == source:
            return base + spans.index(statements(family)[which])
        base += len(spans)
    raise KeyError(family)


def delete(lib, family: str | None, which: int = 0) -> None:
    """In the loaded build ``lib`` of :func:`sources`, statement ``which`` of ``family`` deleted
    (None: every statement back)."""
    ctypes.c_int.in_dll(lib, SWITCH).value = -1 if family is None else number(family, which)
