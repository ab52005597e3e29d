"""A misspelt ``zero`` option is answered with the name the config accepts today, never the legacy one."""
import pytest

from colossal_lite.context import ConfigException
from colossal_lite.context.validation import load_config


@pytest.mark.parametrize("option, meant", [
    ("offload", "offload_optimizer"),          # close to the legacy cpu_offload: its successor is meant
    ("cpu_ofload", "offload_optimizer"),
    ("offload_optimiser", "offload_optimizer"),
    ("levl", "stage"),                          # close to the legacy level
    ("stages", "stage"),
    ("shard_module", "shard_modules"),
])
def test_a_misspelt_zero_option_suggests_todays_name(option, meant):
    with pytest.raises(ConfigException) as e:
        load_config({"zero": {"stage": 2, option: True}})
    message = str(e.value)
    assert message.startswith(f"<dict config>: config key 'zero.{option}': not an option of zero. "
                              f"Fix: remove it (did you mean '{meant}'?) (accepted: stage, offload_optimizer, "
                              f"shard_modules, reshard_after_forward)"), message
    assert "cpu_offload'" not in message and "'level'" not in message


def test_the_suggested_name_is_accepted():
    assert load_config({"zero": {"stage": 2, "offload_optimizer": True}}).zero.offload_optimizer is True


def test_a_name_close_to_nothing_gets_no_suggestion():
    with pytest.raises(ConfigException) as e:
        load_config({"zero": {"stage": 2, "verbos": True}})  # close to the legacy verbose, which has no successor
    assert "did you mean" not in str(e.value)
