"""The test tiers of tests/conftest.py: the rule marks the tests that start processes ``slow``, and the guard fails
an unmarked test that starts one anyway, even when the test catches the error."""
import shutil
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader

from colossal_lite.testing import rerun_if_address_is_in_use, spawn


def start(code):
    return subprocess.run([sys.executable, "-c", code], check=True)


class Launcher:
    def go(self):
        return start("pass")


def _rank(rank, world_size, port):
    pass


def test_plain():
    assert 1 + 1 == 2


def test_through_a_helper():
    start("pass")


def test_through_a_method_of_a_helper_class():
    Launcher().go()


def test_with_a_local_import():
    import subprocess as sp
    sp.check_output([sys.executable, "-c", "pass"])


@rerun_if_address_is_in_use()
def test_decorated_spawn():
    spawn(_rank, nprocs=1)


def test_loader_workers():
    assert len(list(DataLoader(range(4), num_workers=1))) == 4


@pytest.fixture
def launched():
    return start("pass")


def test_through_a_fixture(launched):
    pass


def test_hidden_start_fails_even_when_caught():
    run = getattr(subprocess, "".join(["r", "un"]))  # out of the rule's sight
    try:
        run([sys.executable, "-c", "pass"])
    except RuntimeError:
        pass


@pytest.mark.slow
def test_marked_by_hand():
    getattr(subprocess, "".join(["r", "un"]))([sys.executable, "-c", "pass"], check=True)
'''


@pytest.mark.slow  # starts pytest in a subprocess (through pytester, which the rule does not read)
def test_the_rule_marks_process_tests_and_the_guard_fails_an_unmarked_one(pytester):
    shutil.copy(TESTS / "conftest.py", pytester.path / "conftest.py")
    pytester.makepyfile(test_sample=textwrap.dedent(SAMPLE))
    pytester.makeini("[pytest]\nmarkers =\n    slow: test\n")

    fast = pytester.runpytest_subprocess("-m", "not slow", "-p", "no:cacheprovider", "-q")
    fast.assert_outcomes(passed=1, failed=1, deselected=7)
    fast.stdout.fnmatch_lines(["*test_hidden_start_fails_even_when_caught started a process (subprocess.Popen(*"
                               "but is not marked slow*"])

    slow = pytester.runpytest_subprocess("-m", "slow", "-p", "no:cacheprovider", "-q", "--collect-only")
    slow.stdout.fnmatch_lines(["*test_through_a_helper*", "*test_through_a_method_of_a_helper_class*",
                               "*test_with_a_local_import*", "*test_decorated_spawn*", "*test_loader_workers*",
                               "*test_through_a_fixture*", "*test_marked_by_hand*", "7/9 tests collected*"])
