"""``--set KEY=false`` means False: the words true/false/none/null in any case are read as YAML, Hydra and
LightningCLI read them, and a value that stays a string where the key needs another type is refused with the
fix spelled as an override that works on the command line."""
import pytest

from colossal_lite.cli import main
from colossal_lite.context import ConfigException
from colossal_lite.context.overrides import cli_spelling, parse_override
from colossal_lite.context.validation import load_config


@pytest.mark.parametrize("text, value", [
    ("zero.offload_optimizer=false", False), ("X=False", False), ("X=FALSE", False),
    ("X=true", True), ("X=True", True), ("X=TRUE", True),
    ("X=none", None), ("X=None", None), ("X=null", None), ("X=NULL", None),
    ("X='false'", "false"), ('X="null"', "null"),   # quoted: the user asked for the string
    ("X=falsey", "falsey"),
])
def test_the_words_true_false_none_null_are_read_in_any_case(text, value):
    assert parse_override(text)[1] == value
    assert type(parse_override(text)[1]) is type(value)


def test_set_false_switches_an_option_off_and_check_says_so(tmp_path, capsys):
    config = load_config({"zero": {"stage": 2}}, ["zero.offload_optimizer=false"])
    assert config.zero.offload_optimizer is False
    path = str(tmp_path / "zero2.py")
    (tmp_path / "zero2.py").write_text("zero = dict(stage=2)\n")
    assert main(["check", path, "--set", "zero.offload_optimizer=false"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2" in out and "offloaded" not in out, out
    assert main(["check", path, "--set", "zero.offload_optimizer=True"]) == 0
    assert "optimizer offloaded to CPU" in capsys.readouterr().out


@pytest.mark.parametrize("override, message", [
    ("cudnn_benchmark=yes", "--set cudnn_benchmark=yes: config key 'cudnn_benchmark': expected True or False, got "
                            "'yes'. Fix: write --set cudnn_benchmark=True"),
    ("grad_reduction=Sum", "--set grad_reduction=Sum: config key 'grad_reduction': expected 'mean', 'sum' or "
                           "'per-token-mean', got 'Sum'. Fix: write --set grad_reduction=sum"),
    ("gradient_accumulation=four", "Fix: write e.g. --set gradient_accumulation=4"),
    ("dist_timeout=10min", "Fix: write e.g. --set dist_timeout=300"),
    ("zero.stage=two", "--set zero.stage=two: config key 'zero.stage': expected 1, 2 or 3, got 'two'. "
                       "Fix: write e.g. --set zero.stage=2"),
])
def test_a_string_where_another_type_is_needed_is_refused_with_the_override_that_works(override, message):
    with pytest.raises(ConfigException) as e:
        load_config({"zero": {"stage": 1}} if override.startswith("zero") else {}, [override])
    assert message in str(e.value), e.value


def test_the_same_mistake_in_a_config_file_keeps_the_config_spelling(tmp_path):
    path = tmp_path / "config.py"
    path.write_text("cudnn_benchmark = 'yes'\n")
    with pytest.raises(ConfigException, match=r"config\.py:1: config key 'cudnn_benchmark': .* Fix: write "
                                              r"cudnn_benchmark = True$"):
        load_config(path, ["BATCH_SIZE=2"])


@pytest.mark.parametrize("value, text", [
    (True, "True"), (None, "None"), (2, "2"), (0.5, "0.5"), ("sum", "sum"), ("per-token-mean", "per-token-mean"),
    ("true", "'true'"), ("8", "'8'"), ("two words ", "'two words '"), ([1, 2], "[1, 2]"),
])
def test_cli_spelling_reads_back_as_the_value(value, text):
    assert cli_spelling(value) == text
    assert parse_override(f"X={text}")[1] == value
