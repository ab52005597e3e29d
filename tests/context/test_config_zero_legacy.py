"""The legacy ``zero = dict(level=..., cpu_offload=..., verbose=...)`` of older Colossal-AI examples is read in
today's names with an info line; anything else inside ``zero`` is still refused with file:line, key and fix."""
import pytest

from colossal_lite.cli import main as cli_main
from colossal_lite.context import ConfigException
from colossal_lite.launch import load_config

HEADER = "BATCH_SIZE = 8\n"  # the case starts on line 2


def _write(tmp_path, body):
    path = tmp_path / "config.py"
    path.write_text(HEADER + body)
    return path


def test_legacy_form_is_mapped_to_stage_and_offload_with_an_info_line(tmp_path, capsys):
    path = _write(tmp_path, "zero = dict(level=2, cpu_offload=True, verbose=False)\n")
    cfg = load_config(path)
    assert dict(cfg.zero) == dict(stage=2, offload_optimizer=True)
    out = capsys.readouterr().out
    assert "INFO" in out and f"{path}:2: config key 'zero': the legacy form " \
        "dict(level=2, cpu_offload=True, verbose=False) is read as zero = dict(stage=2, offload_optimizer=True) " \
        "(verbose has no effect)" in out


def test_legacy_form_without_offload_keeps_the_default(tmp_path):
    cfg = load_config(_write(tmp_path, "zero = dict(level=1, cpu_offload=False)\n"))
    assert dict(cfg.zero) == dict(stage=1)  # stage 1 has no offload option, and False is the default anyway


def test_check_accepts_the_legacy_form_and_explains_it(tmp_path, capsys):
    path = _write(tmp_path, "zero = dict(level=3, cpu_offload=True, verbose=True)\n")
    assert cli_main(["check", str(path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "is read as zero = dict(stage=3, offload_optimizer=True)" in out
    assert "ZeRO stage 3: parameters, gradients and optimizer state sharded (FSDP2), optimizer offloaded to CPU" in out


@pytest.mark.parametrize("body,key,problem,fix", [
    ("zero = dict(level=2, cpu_ofload=True)\n", "zero.cpu_ofload", "not an option of zero",
     "did you mean 'offload_optimizer'"),  # today's name, which any form accepts
    ("zero = dict(level=2, sharding=True)\n", "zero.sharding", "not an option of zero",
     "accepted: stage, offload_optimizer, shard_modules, reshard_after_forward"),
    ("zero = dict(level=4)\n", "zero.level", "expected 1, 2 or 3 (the ZeRO stage), got 4",
     "write e.g. zero = dict(stage=2)"),
    ("zero = dict(level='2')\n", "zero.level", "got '2'", "write zero = dict(stage=2)"),
    ("zero = dict(level=2, stage=2)\n", "zero.level", "is the legacy name of 'stage', which is set too",
     "remove 'level'"),
    ("zero = dict(level=2, cpu_offload=True, offload_optimizer=True)\n", "zero.cpu_offload",
     "legacy name of 'offload_optimizer'", "remove 'cpu_offload'"),
    ("zero = dict(level=2, cpu_offload='yes')\n", "zero.cpu_offload", "expected True or False",
     "write cpu_offload=True"),
    ("zero = dict(level=1, cpu_offload=True)\n", "zero", "are FSDP2 options, but stage 1", "use zero=dict(stage=2)"),
])
def test_bad_legacy_values_are_refused_with_file_line_key_and_fix(tmp_path, body, key, problem, fix):
    path = _write(tmp_path, body)
    with pytest.raises(ConfigException) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}:2: config key '{key}': ")
    problem_part, fix_part = message.split(". Fix: ")
    assert problem in problem_part and fix in fix_part
