"""The run's cache of host builds (tests/helpers/host_build.py): a build is keyed by everything
that goes into it, two processes that need the same build at once compile it once and both get
the whole library, a failed build leaves nothing behind, and every load is an instance of its
own (the shim's globals are not shared between two fixtures)."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import host_build, mutants

TESTS = Path(__file__).resolve().parents[1]


def test_the_key_follows_every_input():
    plain = host_build.key("harness.cpp")
    assert plain == host_build.key("harness.cpp", {})
    assert plain != host_build.key("harness_fused.cpp")
    text = mutants.text("lltm.cu")
    assert host_build.key("harness.cpp", {"lltm.cu": text}) != plain   # named as replaced
    assert host_build.key("harness.cpp", {"lltm.cu": text + "\n"}) != \
        host_build.key("harness.cpp", {"lltm.cu": text})
    assert host_build.key("harness_fused.cpp", mutants.sources("harness_fused.cpp")) == \
        host_build.key("harness_fused.cpp", mutants.sources("harness_fused.cpp"))


_BUILD = """
    import sys
    sys.path.insert(0, {tests!r})
    from helpers import host_build
    host_build.configure({cache!r})
    path = host_build.built("harness.cpp")
    print(path, host_build.events[host_build.key("harness.cpp")])
"""


def test_two_processes_building_at_once_compile_once(tmp_path):
    """Two processes (two xdist workers) ask for the same build at the same moment: one compiles
    it, the other waits for it and finds it; both get the same complete library, and the cache
    holds that library and no half-written file."""
    cache = tmp_path / "cache"
    code = textwrap.dedent(_BUILD.format(tests=str(TESTS), cache=str(cache)))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    said = sorted(out.split() for out, _ in results)
    assert said[0][0] == said[1][0], said
    assert sorted(word for _, word in said) == ["compiled", "found"], said
    libraries = sorted(cache.glob("*.so"))
    assert [str(p) for p in libraries] == [said[0][0]], libraries
    assert not [p for p in cache.iterdir() if p.is_dir()], list(cache.iterdir())   # no leftovers
    lib = ctypes.CDLL(str(libraries[0]))
    assert lib.lltm_host_ieee_mode is not None


def test_a_failed_build_leaves_nothing_in_the_cache(tmp_path):
    cache, run_cache = tmp_path / "cache", host_build.cache_folder()
    host_build.configure(cache)
    try:
        with pytest.raises(AssertionError, match="host build failed"):
            host_build.built("harness.cpp", {"lltm.cu": "this is not C++\n"})
        assert not list(cache.glob("*.so")), list(cache.iterdir())
        assert not [p for p in cache.iterdir() if p.is_dir()], list(cache.iterdir())
    finally:
        host_build.configure(run_cache)


def test_each_load_is_an_instance_of_its_own(tmp_path, host_lib):
    """Two loads of one build (into one folder, too) are two instances: the shim's globals of
    one (the mutants' switch here) are not the other's."""
    library = host_build.built("harness.cpp", scratch=tmp_path)
    first = host_build.load(library, tmp_path / "loads", "lib.so")
    second = host_build.load(library, tmp_path / "loads", "lib.so")
    one, two = (ctypes.c_int.in_dll(lib, mutants.SWITCH) for lib in (first, second))
    assert one.value == two.value == -1
    one.value = 3
    assert two.value == -1
    assert ctypes.c_int.in_dll(host_lib, mutants.SWITCH).value == -1


def test_the_run_shares_one_cache(tmp_path_factory, request):
    """Every process of the run (each pytest-xdist worker) uses the same folder: the one under
    the run's base temporary folder."""
    folder = host_build.cache_folder()
    assert folder is not None and folder.name == "host-builds"
    base = tmp_path_factory.getbasetemp()
    assert folder.parent == (base.parent if hasattr(request.config, "workerinput") else base)
