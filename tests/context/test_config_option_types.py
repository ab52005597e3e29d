"""Every option inside a feature dict is checked at launch with its type, like the top-level keys: a string
where a flag is needed (truthy, so it switched the option on) or a wrong type that DDP's constructor would
refuse with a pybind TypeError naming neither the key nor the fix."""
import pytest

from colossal_lite.cli import main
from colossal_lite.context import ConfigException
from colossal_lite.context.option_types import check_zero_world_size
from colossal_lite.context.validation import compile_modes, load_config
from colossal_lite.launch import launch
from colossal_lite.registry import GRADIENT_HANDLER


def refused(config, overrides=()):
    with pytest.raises(ConfigException) as e:
        load_config(config, list(overrides))
    return str(e.value)


@pytest.mark.parametrize("config, message", [
    ({"torch_ddp": {"find_unused_parameters": "false"}},
     "<dict config>: config key 'torch_ddp.find_unused_parameters': expected True or False, got 'false'. "
     "Fix: write find_unused_parameters=False"),
    ({"torch_ddp": {"broadcast_buffers": "no"}}, "config key 'torch_ddp.broadcast_buffers': expected True or False "
                                                 "(or None), got 'no'. Fix: write broadcast_buffers=False"),
    ({"torch_ddp": {"gradient_as_bucket_view": 1}}, "Fix: write gradient_as_bucket_view=True"),
    ({"torch_ddp": {"static_graph": "on"}}, "Fix: write static_graph=True"),
    ({"torch_ddp": {"bucket_cap_mb": "25"}}, "config key 'torch_ddp.bucket_cap_mb': expected a number of MiB > 0 "
                                             "(or None), got '25'. Fix: write bucket_cap_mb=25"),
    ({"torch_ddp": {"dim": 1.0}}, "config key 'torch_ddp.dim': expected an int (the batch dimension), got 1.0. "
                                  "Fix: write dim=1"),
    ({"zero": {"stage": 2, "offload_optimizer": "false"}},
     "config key 'zero.offload_optimizer': expected True or False, got 'false'. Fix: write offload_optimizer=False"),
    ({"zero": {"stage": 3, "shard_modules": "Block"}},
     "config key 'zero.shard_modules': expected a list of module class names, got 'Block'. "
     "Fix: write shard_modules=['Block']"),
    ({"zero": {"stage": 3, "reshard_after_forward": "false"}},
     "config key 'zero.reshard_after_forward': expected True, False, None or a positive int, got 'false'. "
     "Fix: write reshard_after_forward=False"),
    ({"gradient_handler": [{"type": "DataParallelGradientHandler", "bucket_size_mb": "8"}]},
     "config key 'gradient_handler[0].bucket_size_mb': expected a number of MiB > 0, got '8'. "
     "Fix: write bucket_size_mb=8"),
    ({"fp16": {"mode": "torch", "enabled": "no"}}, "config key 'fp16.enabled': expected True or False, got 'no'. "
                                                   "Fix: write enabled=False"),
    ({"compile": {"fullgraph": "true"}}, "config key 'compile.fullgraph': expected True or False, got 'true'. "
                                         "Fix: write fullgraph=True"),
    # passed the check and failed inside torch.compile at initialize, or at the first forward (found by a probe)
    ({"compile": {"mode": "fast"}}, "config key 'compile.mode': unknown torch.compile mode 'fast'. Fix: write e.g. "
                                    "mode='default' (accepted: default, "),
    ({"compile": {"mode": "max_autotune"}}, "Fix: write mode='max-autotune' (accepted: "),
    ({"compile": {"backend": 3}}, "config key 'compile.backend': expected a backend name or a callable "
                                  "(torch.compile's backend), got 3. Fix: write e.g. backend='inductor'"),
    ({"compile": {"mode": "default", "options": {}}}, "config key 'compile.mode': torch.compile takes 'mode' or "
                                                       "'options', not both"),
])
def test_an_option_of_the_wrong_type_is_refused_naming_key_and_fix(config, message):
    assert message in refused(config)


def test_the_error_names_the_file_and_line_and_check_refuses_it(tmp_path, capsys):
    path = tmp_path / "config.py"
    path.write_text("BATCH_SIZE = 8\ntorch_ddp = dict(\n    broadcast_buffers=False,\n"
                    "    find_unused_parameters='false',\n)\n")
    assert refused(path).startswith(f"{path}:4: config key 'torch_ddp.find_unused_parameters': expected True or "
                                    f"False, got 'false'. Fix: write find_unused_parameters=False")
    assert main(["check", str(path)]) == 1
    assert "torch_ddp.find_unused_parameters" in capsys.readouterr().err


def test_on_the_command_line_the_fix_is_the_override_that_works():
    assert refused({"zero": {"stage": 2}}, ["zero.offload_optimizer=yes"]) == (
        "--set zero.offload_optimizer=yes: config key 'zero.offload_optimizer': expected True or False, got 'yes'. "
        "Fix: write --set zero.offload_optimizer=True")
    assert "Fix: write e.g. --set torch_ddp.find_unused_parameters=True" in refused(
        {}, ["torch_ddp.find_unused_parameters=maybe"])
    assert "Fix: write --set torch_ddp.bucket_cap_mb=25" in refused({}, ["torch_ddp.bucket_cap_mb='25'"])
    # and the words the command line reads as flags pass
    config = load_config({}, ["torch_ddp.find_unused_parameters=false", "torch_ddp.broadcast_buffers=TRUE"])
    assert config.torch_ddp == {"find_unused_parameters": False, "broadcast_buffers": True}


@pytest.mark.parametrize("config", [
    {"torch_ddp": {"find_unused_parameters": True, "broadcast_buffers": False, "bucket_cap_mb": 50,
                   "gradient_as_bucket_view": True, "static_graph": False, "dim": 0}},
    {"torch_ddp": {"broadcast_buffers": None, "bucket_cap_mb": None}},
    {"zero": {"stage": 3, "offload_optimizer": True, "shard_modules": ["Block"], "reshard_after_forward": 2}},
    {"zero": {"stage": 2, "shard_modules": ("Block", "Head"), "reshard_after_forward": None}},
    {"gradient_handler": [{"type": "DataParallelGradientHandler", "bucket_size_mb": 12.5}]},
    {"compile": {"mode": "max-autotune", "fullgraph": True, "dynamic": None}},
    {"compile": {"mode": "lite"}},  # a mode of recent torch, taken from torch itself
    {"compile": {"options": {"triton.cudagraphs": False}, "backend": "inductor"}},
    {"compile": {"mode": "anything", "backend": "eager"}},  # another backend reads the mode in its own way
    {"compile": {"backend": lambda gm, example_inputs: gm}},
])
def test_options_of_the_right_type_pass(config):
    load_config(config)


@pytest.fixture
def flagged_handler():
    @GRADIENT_HANDLER.register_module(name="FlaggedHandler")
    class FlaggedHandler:
        def __init__(self, model, optimizer, average=True, scale=1.0):
            pass

    yield "FlaggedHandler"
    GRADIENT_HANDLER._registry.pop("FlaggedHandler", None)


def test_a_flag_of_a_registered_handler_must_be_a_bool(flagged_handler):
    message = refused({"gradient_handler": [{"type": flagged_handler, "average": "false"}]})
    assert "config key 'gradient_handler[0].average': expected True or False, got 'false'. " \
           "Fix: write average=False" in message
    load_config({"gradient_handler": [{"type": flagged_handler, "average": False, "scale": "anything"}]})


def test_the_compile_modes_are_the_installed_torchs():
    from torch._inductor import list_mode_options

    assert set(compile_modes()) == {"default", *list_mode_options()}


@pytest.mark.parametrize("reshard, world_size", [(3, 2), (2, 3), (4, 2), (2, 1)])
def test_a_reshard_group_that_does_not_divide_the_world_size_is_refused_at_launch(tmp_path, capsys, reshard,
                                                                                   world_size):
    """FSDP2 refused it inside initialize with a bare ValueError ("should be a factor of 2")."""
    path = tmp_path / "config.py"
    path.write_text(f"zero = dict(\n    stage=3,\n    reshard_after_forward={reshard},\n)\n")
    config = load_config(path)
    with pytest.raises(ConfigException) as e:
        check_zero_world_size(config, world_size)
    factors = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
    assert str(e.value) == (
        f"{path}:3: config key 'zero.reshard_after_forward': {reshard} is not a factor of the world size {world_size} "
        f"(FSDP2 reshards each unit's parameters to groups of that many ranks after its forward). Fix: use a factor "
        f"of {world_size} ({factors}), True (reshard to all ranks) or False")
    assert main(["check", str(path), "--world-size", str(world_size)]) == 1
    assert "zero.reshard_after_forward" in capsys.readouterr().err
    if world_size > 1:  # launch refuses it before it starts a process group (no peer will come)
        with pytest.raises(ConfigException, match="is not a factor of the world size"):
            launch(str(path), rank=0, world_size=world_size, host="127.0.0.1", port=29779, timeout=5, verbose=False)


@pytest.mark.parametrize("zero, world_size", [
    ({"stage": 3, "reshard_after_forward": 2}, 4), ({"stage": 2, "reshard_after_forward": 2}, 2),
    ({"stage": 3, "reshard_after_forward": True}, 3), ({"stage": 3}, 3),
])
def test_a_reshard_group_that_divides_the_world_size_passes(zero, world_size):
    check_zero_world_size(load_config({"zero": zero}), world_size)
