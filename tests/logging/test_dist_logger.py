"""get_dist_logger: rank filtering (in 1 and 2 processes), plain output off a terminal, log_to_file."""
import io
import itertools
import logging
import re
import textwrap

import pytest
from dist_helpers import run_ranks

from colossal_lite.logging import disable_existing_loggers, get_dist_logger
from colossal_lite.logging import logger as logger_module

ANSI = re.compile(r"\x1b\[")
_names = itertools.count()


@pytest.fixture
def logger(monkeypatch):
    """A fresh logger of its own name, closed afterwards (loggers are process-wide singletons)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    name = f"test_logger_{next(_names)}"
    log = get_dist_logger(name)
    yield log
    for handler in list(log._logger.handlers):
        log._logger.removeHandler(handler)
        handler.close()
    logger_module._loggers.pop(name, None)


def test_one_logger_per_name_and_legacy_default_name():
    assert get_dist_logger() is get_dist_logger("colossal_lite")
    assert get_dist_logger("colossalai") is get_dist_logger()  # scripts that pass the legacy name
    assert get_dist_logger().get_instance("colossal_lite") is get_dist_logger()


def test_prints_before_launch_in_plain_text(logger, capsys):
    logger.info("hello before launch")
    out = capsys.readouterr().out
    assert out == f"{logger.name} - INFO: hello before launch\n"
    assert not ANSI.search(out)


def test_rank_filtering_in_one_process(logger, capsys):
    logger.info("to rank 0", ranks=[0])
    logger.info("to rank 1", ranks=[1])
    logger.info("to both", ranks=[0, 1])
    logger.warning("a warning")
    logger.warning("a warning for rank 1", ranks=[1])
    logger.error("an error")
    logger.error("an error for rank 1", ranks=[1])
    logger.info("everyone", ranks="all")
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{logger.name} - INFO: to rank 0", f"{logger.name} - INFO: to both",
                   f"{logger.name} - WARNING: a warning", f"{logger.name} - ERROR: an error",
                   f"{logger.name} - INFO: everyone"]


def test_rank_comes_from_the_environment_before_launch(logger, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # e.g. torchrun's rank 1 logging before launch_from_torch
    logger.info("info by default on rank 0 only")
    logger.info("for rank 1", ranks=[1])
    logger.error("errors everywhere")
    out = capsys.readouterr().out
    assert "info by default" not in out and "for rank 1" in out and "errors everywhere" in out


def test_a_line_from_another_rank_names_it(logger, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    logger.info("for rank 3", ranks=[3])
    logger.error("an error")
    monkeypatch.setenv("RANK", "0")
    logger.error("rank 0 as before")
    assert capsys.readouterr().out.splitlines() == [f"{logger.name} [rank 3] - INFO: for rank 3",
                                                    f"{logger.name} [rank 3] - ERROR: an error",
                                                    f"{logger.name} - ERROR: rank 0 as before"]


def test_levels(logger, capsys):
    logger.debug("hidden at the default INFO level")
    logger.set_level("DEBUG")
    logger.debug("shown at DEBUG")
    logger.set_level("error")
    logger.warning("hidden at ERROR")
    logger.error("shown at ERROR")
    out = capsys.readouterr().out
    assert "hidden" not in out and "shown at DEBUG" in out and "shown at ERROR" in out
    with pytest.raises(ValueError, match="DEBUG, INFO, WARNING, ERROR"):
        logger.set_level("VERBOSE")


def test_terminal_output_goes_through_rich(logger, monkeypatch):
    class FakeTerminal(io.StringIO):
        def isatty(self):
            return True

    stream = FakeTerminal()
    monkeypatch.setattr("sys.stdout", stream)
    logger.info("shown through rich")
    handler = logger._logger.handlers[-1]
    assert type(handler).__name__ == "RichHandler"
    assert "shown through rich" in stream.getvalue()


def test_no_color_forces_plain_output(logger, monkeypatch):
    class FakeTerminal(io.StringIO):
        def isatty(self):
            return True

    stream = FakeTerminal()
    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setenv("NO_COLOR", "1")
    logger.warning("plain please")
    assert stream.getvalue() == f"{logger.name} - WARNING: plain please\n"


def test_log_to_file_writes_rank_file_into_the_folder(logger, tmp_path, capsys):
    folder = tmp_path / "logs" / "run1"  # created when missing
    logger.log_to_file(folder)
    logger.log_to_file(folder)  # twice: still one handler, so each line once
    logger.info("first message")
    logger.info("only for rank 1", ranks=[1])  # this rank's file still gets it
    logger.debug("below the file level")
    text = (folder / "rank_0.log").read_text()
    assert text.count("first message") == 1 and "only for rank 1" in text and "below the file level" not in text
    assert f"{logger.name} - INFO: first message" in text
    assert "only for rank 1" not in capsys.readouterr().out


def test_log_to_file_suffix_level_and_mode(logger, tmp_path):
    (tmp_path / "rank_0_eval.log").write_text("old content\n")
    logger.set_level("DEBUG")
    logger.log_to_file(tmp_path, mode="w", level="WARNING", suffix="eval")
    logger.info("an info line")
    logger.warning("a warning line")
    text = (tmp_path / "rank_0_eval.log").read_text()
    assert "old content" not in text and "an info line" not in text and "a warning line" in text
    with pytest.raises(ValueError, match="logging level"):
        logger.log_to_file(tmp_path, level="LOUD")
    a_file = tmp_path / "not_a_folder.txt"
    a_file.write_text("")
    with pytest.raises(NotADirectoryError, match="folder"):
        logger.log_to_file(a_file)


def test_disable_existing_loggers():
    other = logging.getLogger("some_library.sub")
    other.setLevel(logging.DEBUG)
    ours = logging.getLogger("colossal_lite")
    ours_level = ours.level
    kept = logging.getLogger("kept_library")
    kept.setLevel(logging.DEBUG)
    disable_existing_loggers(exclude=["colossal_lite", "kept_library"])
    assert other.level == logging.WARNING and kept.level == logging.DEBUG and ours.level == ours_level
    only = logging.getLogger("only_this_one")
    only.setLevel(logging.DEBUG)
    other.setLevel(logging.DEBUG)
    disable_existing_loggers(include=["only_this_one"])
    assert only.level == logging.WARNING and other.level == logging.DEBUG


TWO_PROCESS_SCRIPT = textwrap.dedent("""\
    import os, sys
    import torch.distributed as dist
    from colossal_lite import launch_from_torch
    from colossal_lite.core import global_context as gpc
    from colossal_lite.logging import get_dist_logger

    logger = get_dist_logger()
    env_rank = os.environ["RANK"]
    logger.log_to_file(sys.argv[1])  # before launch: the rank comes from torchrun's RANK
    logger.info(f"MSG before-launch-default from rank {env_rank}")
    launch_from_torch(config={}, verbose=False)
    rank = gpc.get_global_rank()
    logger.info(f"MSG info-default from rank {rank}")
    logger.info(f"MSG info-ranks0 from rank {rank}", ranks=[0])
    logger.info(f"MSG info-ranks1 from rank {rank}", ranks=[1])
    logger.info(f"MSG info-ranks01 from rank {rank}", ranks=[0, 1])
    logger.warning(f"MSG warning-default from rank {rank}")
    logger.debug(f"MSG debug-default from rank {rank}")
    logger.error(f"MSG error-default from rank {rank}")
    logger.error(f"MSG error-ranks0 from rank {rank}", ranks=[0])
    dist.barrier()
    gpc.destroy()
    """)


def test_rank_filtering_in_two_processes(tmp_path):
    script = tmp_path / "log_two.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    logs = tmp_path / "logs"
    proc = run_ranks(script, [logs], nproc=2, timeout=120)
    assert not ANSI.search(proc.stdout) and not ANSI.search(proc.stderr)  # a pipe, not a terminal: plain lines
    printed = sorted(line.split("MSG ", 1)[1] for line in proc.stdout.splitlines() if "MSG " in line)
    expected = sorted([
        "before-launch-default from rank 0",
        "info-default from rank 0",
        "info-ranks0 from rank 0",
        "info-ranks1 from rank 1",
        "info-ranks01 from rank 0", "info-ranks01 from rank 1",
        "warning-default from rank 0",
        "error-default from rank 0", "error-default from rank 1",  # errors print on every rank by default
        "error-ranks0 from rank 0",
    ])
    assert printed == expected, proc.stdout
    # a line from rank 1 says so (issue 23); rank 0's lines stay as they were
    assert "colossal_lite [rank 1] - ERROR: MSG error-default from rank 1" in proc.stdout.splitlines()
    assert "colossal_lite - ERROR: MSG error-default from rank 0" in proc.stdout.splitlines()
    for line in proc.stdout.splitlines():
        if "MSG " in line:
            from_rank = line.rsplit(" ", 1)[1]
            assert line.startswith("colossal_lite [rank 1] - " if from_rank == "1" else "colossal_lite - "), line
    for rank in (0, 1):
        text = (logs / f"rank_{rank}.log").read_text()
        other = 1 - rank
        assert f"from rank {other}" not in text
        assert f"MSG info-ranks01 from rank {rank}" in text and f"MSG error-default from rank {rank}" in text
        assert "debug-default" not in text
