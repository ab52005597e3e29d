"""A precision mode on the command line: the config file's names (``AMP_TYPE.BF16``) are not known there, so a fix
must give the spelling that works with ``--set`` (``fp16.mode=bf16``), not the one that was typed."""
import pytest

from colossal_lite.context import ConfigException
from colossal_lite.context.validation import load_config


def refused(config, overrides):
    with pytest.raises(ConfigException) as e:
        load_config(config, overrides)
    return str(e.value)


@pytest.mark.parametrize("override, fix", [
    ("fp16.mode=AMP_TYPE.BF16", "write --set fp16.mode=bf16"),
    ("fp16.mode=AMP_TYPE.TORCH", "write --set fp16.mode=torch"),
    ("fp16.mode=amp_type.naive", "write --set fp16.mode=naive"),
    ("fp16.mode=bfloat16", "write --set fp16.mode=bf16"),
    ("fp16.mode=fp32", "write --set fp16=None (fp32)"),
    ("fp16=bf16", "write --set fp16.mode=bf16"),
    ("fp16=AMP_TYPE.BF16", "write --set fp16.mode=bf16"),
    ("fp16.mode=xyzzy", "write --set fp16.mode=torch, --set fp16.mode=bf16, --set fp16.mode=naive or --set fp16=None "
                        "(AMP_TYPE names are not known on the command line)"),
    ("fp16.mode=apex", "write --set fp16.mode=torch (torch autocast + GradScaler, the same O1 behaviour) or "
                       "--set fp16.mode=naive (O3-like)"),
])
def test_a_mode_given_with_set_gets_the_fix_spelled_for_the_command_line(override, fix):
    message = refused({}, [override])
    assert message.startswith(f"--set {override}: config key 'fp16"), message
    assert message.endswith(f"Fix: {fix}"), message
    assert "AMP_TYPE." not in message.partition("Fix:")[2].replace("AMP_TYPE names", "")


def test_the_fix_that_works_is_accepted():
    assert load_config({}, ["fp16.mode=bf16"]).fp16.mode == "bf16"
    assert load_config({"fp16": {"mode": "torch"}}, ["fp16=None"]).fp16 is None


def test_in_a_config_file_the_fix_keeps_the_amp_type_names(tmp_path):
    path = tmp_path / "config.py"
    path.write_text("fp16 = dict(mode='AMP_TYPE.BF16')\n")
    assert refused(path, []).endswith("Fix: write mode=AMP_TYPE.BF16 (from colossal_lite.amp import AMP_TYPE)")
    path.write_text("from colossal_lite.amp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.APEX)\n")
    assert "Fix: use AMP_TYPE.TORCH" in refused(path, [])
