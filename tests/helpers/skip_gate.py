"""The CI gate on skips: with ``--gpu-skips-only`` the run fails if any test or test module was
skipped for a reason other than a missing GPU. On a GPU machine (``scripts/gpu_check.sh``),
``--skips-allowed TEXT`` (repeatable) is stricter: the run fails on any skip whose reason
contains none of the TEXTs given, a missing GPU included.

Every skip for want of a GPU states its reason starting with :data:`GPU_PHRASE` (see
``tests/conftest.py``); any other skip (a module skipped because torch, mpmath, hypothesis or
ml_dtypes failed to install, a skipped compile or host-kernel test) means the run did not test
what it claims to, and ``.ci/run`` must not pass it as green.
"""
from __future__ import annotations

import pytest

GPU_PHRASE = "GPU test:"

_refused = []
_skips = []     # (nodeid, reason) of every skip, for --skips-allowed


def pytest_addoption(parser):
    parser.addoption("--gpu-skips-only", action="store_true", default=False,
                     help=f"fail the run if a test or module is skipped for a reason that does "
                          f"not start with {GPU_PHRASE!r} (used by .ci/run)")
    parser.addoption("--skips-allowed", action="append", default=None, metavar="TEXT",
                     help="fail the run on any skip whose reason contains none of these texts "
                          "(repeatable; used by scripts/gpu_check.sh on a GPU machine)")


def skip_reason(report) -> str:
    """The reason of a skipped report, without pytest's 'Skipped: ' prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def _record(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        _skips.append((report.nodeid or "(session)", reason))
        if not reason.startswith(GPU_PHRASE):
            _refused.append((report.nodeid or "(session)", reason))


def pytest_collectreport(report):
    _record(report)


def pytest_runtest_logreport(report):
    _record(report)


def _not_allowed(config):
    allowed = config.getoption("--skips-allowed")
    if allowed is None:
        return []
    return [(n, r) for n, r in _skips if not any(text in r for text in allowed)]


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    refused = (config.getoption("--gpu-skips-only") and _refused) or _not_allowed(config)
    # a run that only skipped (every module refused) would otherwise exit 5, "no tests ran"
    if refused and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("--gpu-skips-only") and _refused:
        terminalreporter.section("skips refused by --gpu-skips-only", sep="=", red=True)
        for nodeid, reason in _refused:
            module = nodeid.split("::")[0]
            what = "module" if "::" not in nodeid else "test"
            terminalreporter.line(f"SKIP REFUSED: {what} {nodeid} (module {module}): {reason}")
        terminalreporter.line(f"only skips whose reason starts with {GPU_PHRASE!r} (no GPU) "
                              f"may pass; anything else means the run did not test it")
    bad = _not_allowed(config)
    if bad:
        allowed = config.getoption("--skips-allowed")
        terminalreporter.section("skips refused by --skips-allowed", sep="=", red=True)
        for nodeid, reason in bad:
            terminalreporter.line(f"SKIP REFUSED: {nodeid}: {reason}")
        terminalreporter.line(f"allowed only: skips whose reason contains one of {allowed}")
