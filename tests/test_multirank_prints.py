"""Every print to stdout or stderr of a script that the tests run on several ranks is one write of a whole line,
rank 0's too: another rank's line can land inside rank 0's as well (tests/one_write.py says why and how they are
found)."""
import textwrap
from pathlib import Path

import pytest
from one_write import multi_rank_scripts, two_write_prints

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow  # takes seconds without starting a process
def test_every_print_of_a_multi_rank_script_is_one_write_of_a_whole_line():
    bad = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for name, script in multi_rank_scripts(path).items():
            found = two_write_prints(script)
            if found:
                bad[f"{path.relative_to(TESTS)} {name}"] = found
    assert not bad, ("prints that another rank's line can land inside; write each line in one write, "
                     f"print(text + '\\n', end='', flush=True): {bad}")


def test_the_check_finds_the_scripts_that_run_on_several_ranks_and_only_those():
    manager = multi_rank_scripts(TESTS / "checkpoint" / "test_checkpoint_manager.py")
    assert "_TWO_RANKS" in manager and "_FULL_DISK" not in manager  # torchrun, and run_python
    assert "SCRIPT" in multi_rank_scripts(TESTS / "test_multinode.py")  # through the module's helper _agent
    assert "TWO_RANKS" in multi_rank_scripts(TESTS / "checkpoint" / "test_preemption.py")  # COMMON + the rest
    assert "SINGLE" not in multi_rank_scripts(TESTS / "checkpoint" / "test_preemption.py")
    assert "_record_env" in multi_rank_scripts(TESTS / "testing" / "test_testing_utils.py")  # spawn(func, nprocs=2)


def test_the_check_flags_two_writes_and_passes_one(tmp_path):
    module = tmp_path / "test_made_up.py"
    module.write_text(textwrap.dedent('''
        import textwrap
        from dist_helpers import run_torchrun

        SCRIPT = textwrap.dedent("""
            import sys
            print("rank", 0)
            print(f"step {1}", flush=True)
            sys.stdout.write("no newline")
            print(f"step {2}\\\\n", end="", flush=True)
            print("own file", file=open("log.txt", "w"))
            sys.stderr.write(f"rank {1} done" + "\\\\n")
        """)

        def test_it(tmp_path):
            (tmp_path / "s.py").write_text(SCRIPT)
            run_torchrun(tmp_path / "s.py")
    '''))
    (script,) = multi_rank_scripts(module).values()
    assert two_write_prints(script) == ["3: print('rank', 0)", "4: print(f'step {1}', flush=True)",
                                        "5: sys.stdout.write('no newline')"]
