"""Under CI a skip is a failure unless it names missing hardware with conftest's
skip_for_hardware: the rule .ci/run relies on so that a green run cannot hide a missing
install step behind skips."""

from __future__ import annotations

import pytest

from conftest import REPO

pytest_plugins = ["pytester"]

INNER_TESTS = '''
import pytest
from conftest import skip_for_hardware

def test_no_gpu():
    skip_for_hardware("GPU", "no NVIDIA device on this machine")

def test_mentions_a_gpu():
    pytest.skip("mpirun is not installed, so the GPU test cannot run")

def test_no_cluster():
    pytest.skip("the local Slurm cluster is not running: run scripts/cluster up")

@pytest.mark.skipif(True, reason="NCCL is not installed")
def test_marked_with_a_hardware_word():
    pass

def test_runs():
    assert True
'''


def _outcomes(pytester: pytest.Pytester, ci: str | None, monkeypatch) -> dict[str, int]:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER_TESTS)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider").parseoutcomes()


def test_under_ci_only_a_hardware_skip_stays_a_skip(pytester, monkeypatch):
    outcomes = _outcomes(pytester, "true", monkeypatch)
    # A skipif mark skips in setup, so its refusal is reported as an error: a failure too.
    assert outcomes == {"passed": 1, "skipped": 1, "failed": 2, "errors": 1}


def test_outside_ci_every_skip_stays_a_skip(pytester, monkeypatch):
    outcomes = _outcomes(pytester, None, monkeypatch)
    assert outcomes == {"passed": 1, "skipped": 4}


def test_ci_failure_says_why_the_skip_was_refused(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "mentions_a_gpu")
    result.stdout.fnmatch_lines(["*CI: skipped, which CI does not accept*mpirun is not installed*"])
