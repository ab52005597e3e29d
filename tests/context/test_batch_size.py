"""Batch-size arithmetic: global = micro x data-parallel size x accumulation."""
import pytest

from colossal_lite.context import Config, ConfigException
from colossal_lite.context.batch_size import resolve_batch_sizes


@pytest.mark.parametrize("given,world,expected", [
    (dict(micro_batch_size=8, gradient_accumulation=4), 2, dict(global_batch_size=64)),
    (dict(micro_batch_size=8), 4, dict(global_batch_size=32)),
    (dict(global_batch_size=64, gradient_accumulation=4), 2, dict(micro_batch_size=8)),
    (dict(global_batch_size=64, micro_batch_size=8), 2, dict(gradient_accumulation=4)),
    (dict(global_batch_size=64, micro_batch_size=8, gradient_accumulation=4), 2, {}),
    (dict(gradient_accumulation=4), 2, {}),
])
def test_any_two_give_the_third(given, world, expected):
    config = resolve_batch_sizes(Config(given), world)
    for k, v in {**given, **expected}.items():
        assert config[k] == v
    if "micro_batch_size" in config:
        assert config.global_batch_size == config.micro_batch_size * world * config.gradient_accumulation \
            if "gradient_accumulation" in config else config.global_batch_size == config.micro_batch_size * world


@pytest.mark.parametrize("given,world,needle", [
    (dict(global_batch_size=64, micro_batch_size=8, gradient_accumulation=2), 2,
     "micro_batch_size 8 x data-parallel size 2 x gradient_accumulation 2 = 32, not 64"),
    (dict(global_batch_size=60, micro_batch_size=8), 2, "60 is not divisible by micro_batch_size 8 x data-parallel size 2 = 16"),
    (dict(global_batch_size=63, gradient_accumulation=4), 2, "63 is not divisible by data-parallel size 2 x gradient_accumulation 4 = 8"),
    (dict(global_batch_size=64), 2, "needs micro_batch_size or gradient_accumulation to fix the other factors. Fix: "
                                    "add micro_batch_size = 32 (for data-parallel size 2)"),
    # the fix itself must work: 21 x 3 is 63, not 64 (it suggested micro_batch_size = 21; found by a probe)
    (dict(global_batch_size=64), 3, "Fix: global_batch_size 64 is not a multiple of data-parallel size 3: use e.g. "
                                    "global_batch_size = 63 with micro_batch_size = 21"),
    (dict(global_batch_size=1), 2, "use e.g. global_batch_size = 2 with micro_batch_size = 1"),
])
def test_inconsistent_values_show_the_arithmetic(given, world, needle):
    with pytest.raises(ConfigException) as e:
        resolve_batch_sizes(Config(given), world)
    assert needle in str(e.value)
    assert "Fix:" in str(e.value)


def test_check_and_launch_apply_the_arithmetic(tmp_path, capsys):
    from colossal_lite.cli import main
    from colossal_lite.core import global_context as gpc
    from colossal_lite.launch import launch

    cfg = tmp_path / "batch.py"
    cfg.write_text("micro_batch_size = 8\nglobal_batch_size = 64\ngradient_accumulation = 2\n")
    assert main(["check", str(cfg), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "micro batch size: 8" in out and "world size 4" in out
    assert main(["check", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"{cfg}:2: config key 'global_batch_size'" in err and "= 16, not 64" in err
    (tmp_path / "two.py").write_text("micro_batch_size = 8\nglobal_batch_size = 32\n")
    try:
        launch(str(tmp_path / "two.py"), rank=0, world_size=1, host=None, port=None, verbose=False)
        assert gpc.config.gradient_accumulation == 4
    finally:
        gpc.destroy()
