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


MODULE_SKIPS = {
    # A module-level importorskip skips the whole module while it is collected, before
    # any of its tests exists (tests/test_hook_torch.py does this for torch).
    "test_needs_a_module": '''
import pytest

pytest.importorskip("greyhound_no_such_module")

def test_never_made():
    pass
''',
    "test_needs_a_gpu": '''
import pytest

pytest.skip("hardware: GPU: no NVIDIA device on this machine", allow_module_level=True)

def test_never_made():
    pass
''',
}


def _collect_module_skips(pytester: pytest.Pytester, ci: str | None, monkeypatch):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(**MODULE_SKIPS)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_under_ci_a_module_skipped_at_collection_is_an_error(pytester, monkeypatch):
    result = _collect_module_skips(pytester, "true", monkeypatch)
    # The refused skip is a collection error, which stops the run; the module that
    # lacks hardware stays skipped.
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert result.parseoutcomes() == {"errors": 1, "skipped": 1}
    result.stdout.fnmatch_lines([
        "*CI: skipped at collection, which CI does not accept*"
        "could not import 'greyhound_no_such_module'*",
    ])


def test_outside_ci_a_module_skipped_at_collection_stays_skipped(pytester, monkeypatch):
    result = _collect_module_skips(pytester, None, monkeypatch)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    assert result.parseoutcomes() == {"skipped": 2}
