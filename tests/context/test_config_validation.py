"""Every bad config fails before launch with a message naming the file, the line, the key and the fix."""
import textwrap
import warnings
from pathlib import Path

import pytest

from colossal_lite.context import Config, ConfigException
from colossal_lite.context.validation import FEATURE_KEYS, validate_config
from colossal_lite.launch import load_config

HEADER = "from colossal_lite.amp import AMP_TYPE\nBATCH_SIZE = 8\nNUM_EPOCHS = 2\n"  # 3 lines; the case starts on line 4


# (id, source after HEADER, line of the bad key, key named in the message, words of the problem, words of the fix)
BAD_CONFIGS = [
    # fp16
    ("fp16-not-a-dict", "fp16 = 'torch'\n", 4, "fp16", "expected a dict", "fp16 = dict(mode=AMP_TYPE.TORCH)"),
    ("fp16-no-mode", "fp16 = dict(init_scale=2.0)\n", 4, "fp16", "missing 'mode'", "mode=AMP_TYPE.TORCH"),
    ("fp16-unknown-mode", "fp16 = dict(\n    mode='fp8',\n)\n", 5, "fp16.mode", "unknown precision mode 'fp8'",
     "AMP_TYPE.TORCH"),
    ("fp16-apex", "fp16 = dict(\n    mode=AMP_TYPE.APEX,\n    opt_level='O1',\n)\n", 5, "fp16.mode", "apex",
     "AMP_TYPE.TORCH"),
    ("fp16-apex-string", "fp16 = dict(mode='apex')\n", 4, "fp16.mode", "apex", "AMP_TYPE.TORCH"),
    ("fp16-unknown-option", "fp16 = dict(mode=AMP_TYPE.TORCH,\n           init_scal=2.0**10)\n", 5, "fp16.init_scal",
     "not an option of mode TORCH", "did you mean 'init_scale'"),
    ("fp16-option-of-other-mode", "fp16 = dict(mode=AMP_TYPE.TORCH, hysteresis=2)\n", 4, "fp16.hysteresis",
     "not an option of mode TORCH", "accepted: init_scale"),
    ("fp16-bad-option-value", "fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=-1)\n", 4, "fp16.initial_scale",
     "positive number", "initial_scale="),
    ("fp16-bad-interval", "fp16 = dict(mode=AMP_TYPE.TORCH, growth_interval=0.5)\n", 4, "fp16.growth_interval",
     "positive int", "growth_interval=2000"),
    ("fp16-bad-bool", "fp16 = dict(mode=AMP_TYPE.NAIVE, dynamic_grad_scale='yes')\n", 4, "fp16.dynamic_grad_scale",
     "True or False", "dynamic_grad_scale=True"),
    ("fp16-bad-backoff", "fp16 = dict(mode=AMP_TYPE.TORCH, backoff_factor=2.0)\n", 4, "fp16.backoff_factor",
     "between 0 and 1", "backoff_factor=0.5"),
    # clip_grad_norm
    ("clip-negative", "clip_grad_norm = -1.0\n", 4, "clip_grad_norm", "number >= 0", "clip_grad_norm = 1.0"),
    ("clip-string", "clip_grad_norm = '1.0'\n", 4, "clip_grad_norm", "number >= 0", "clip_grad_norm = 1.0"),
    ("clip-bool", "clip_grad_norm = True\n", 4, "clip_grad_norm", "number >= 0", "clip_grad_norm = 1.0"),
    # gradient_accumulation
    ("accum-zero", "gradient_accumulation = 0\n", 4, "gradient_accumulation", "positive int", "gradient_accumulation = 4"),
    ("accum-float", "gradient_accumulation = 2.5\n", 4, "gradient_accumulation", "positive int",
     "gradient_accumulation = 4"),
    # cudnn
    ("cudnn-benchmark-int", "cudnn_benchmark = 1\n", 4, "cudnn_benchmark", "True or False", "cudnn_benchmark = True"),
    ("cudnn-deterministic-str", "cudnn_deterministic = 'yes'\n", 4, "cudnn_deterministic", "True or False",
     "cudnn_deterministic = True"),
    # torch_ddp
    ("ddp-not-a-dict", "torch_ddp = True\n", 4, "torch_ddp", "expected a dict", "find_unused_parameters=True"),
    ("ddp-unknown-kwarg", "torch_ddp = dict(\n    find_unused_parameter=True,\n)\n", 5, "torch_ddp.find_unused_parameter",
     "not a keyword argument", "did you mean 'find_unused_parameters'"),
    ("ddp-reserved-kwarg", "torch_ddp = dict(device_ids=[0])\n", 4, "torch_ddp.device_ids", "set by colossal_lite",
     "remove it"),
    ("ddp-and-handler", "gradient_handler = [dict(type='DataParallelGradientHandler')]\ntorch_ddp = dict(bucket_cap_mb=10)\n",
     5, "torch_ddp", "ignored when 'gradient_handler' is set", "remove one of"),
    # gradient_handler
    ("handler-dict", "gradient_handler = dict(type='DataParallelGradientHandler')\n", 4, "gradient_handler",
     "list of dicts, got a single dict", "gradient_handler = [dict(type='DataParallelGradientHandler')]"),
    ("handler-no-type", "gradient_handler = [dict(bucket_size_mb=10)]\n", 4, "gradient_handler", "with a 'type'",
     "gradient_handler = [dict(type='DataParallelGradientHandler')]"),
    ("handler-unknown", "gradient_handler = [dict(type='ZeROGradientHandler')]\n", 4, "gradient_handler",
     "unknown handler type 'ZeROGradientHandler'", "DataParallelGradientHandler"),
    ("handler-option", "gradient_handler = [dict(type='DataParallelGradientHandler', bucket_mb=1)]\n", 4,
     "gradient_handler", "unknown option(s) ['bucket_mb']", "bucket_size_mb"),
    # parallel
    ("parallel-tensor", "parallel = dict(\n    pipeline=1,\n    tensor=dict(size=2, mode='1d'),\n)\n", 6, "parallel.tensor",
     "tensor parallelism (size 2) is not supported", "remove parallel.tensor"),
    ("parallel-pipeline", "parallel = dict(pipeline=2)\n", 4, "parallel.pipeline",
     "pipeline parallelism (size 2) is not supported", "remove parallel.pipeline"),
    ("parallel-pipeline-dict", "parallel = dict(pipeline=dict(size=4))\n", 4, "parallel.pipeline",
     "pipeline parallelism (size 4)", "remove parallel.pipeline"),
    ("parallel-unknown", "parallel = dict(sequence=2)\n", 4, "parallel.sequence", "unknown parallel mode",
     "only data parallelism"),
    ("parallel-not-dict", "parallel = 2\n", 4, "parallel", "expected a dict", "remove the key"),
    # zero
    ("zero-legacy-form", "zero = dict(\n    model_config=dict(),\n    optimizer_config=dict(),\n)\n", 4, "zero",
     "legacy ShardedModelV2 form", "zero = dict(stage=1|2|3)"),
    ("zero-stage", "zero = dict(stage=4)\n", 4, "zero.stage", "expected 1, 2 or 3", "zero = dict(stage=2)"),
    ("zero-option", "zero = dict(stage=1, offload_optimiser=True)\n", 4, "zero.offload_optimiser", "not an option of zero",
     "did you mean 'offload_optimizer'"),
    ("zero-not-dict", "zero = 2\n", 4, "zero", "expected a dict", "zero = dict(stage=2)"),
    # near-misses of known keys
    ("near-gradient_clipping", "gradient_clipping = 2.0\n", 4, "gradient_clipping", "silently ignored",
     "rename it to 'clip_grad_norm'"),
    ("near-fp_16", "fp_16 = dict(mode=AMP_TYPE.TORCH)\n", 4, "fp_16", "silently ignored", "rename it to 'fp16'"),
    ("near-grad_accumulation", "grad_accumulation = 4\n", 4, "grad_accumulation", "silently ignored",
     "rename it to 'gradient_accumulation'"),
    ("near-clip_grad", "clip_grad = 1.0\n", 4, "clip_grad", "silently ignored", "rename it to 'clip_grad_norm'"),
    ("near-typo", "cudnn_benchmarks = True\n", 4, "cudnn_benchmarks", "silently ignored",
     "rename it to 'cudnn_benchmark'"),
    # keys of later issues, validated already
    ("dist-timeout", "dist_timeout = 0\n", 4, "dist_timeout", "seconds > 0", "dist_timeout = 300"),
]


def _write(tmp_path: Path, body: str, name: str = "train_config.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + body)
    return path


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_message_names_file_line_key_and_fix(tmp_path, case):
    _, body, line, key, problem, fix = case
    path = _write(tmp_path, body)
    with pytest.raises(ConfigException) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    assert f"config key '{key}'" in msg, msg
    assert problem in msg, msg
    assert "Fix: " in msg and fix in msg.split("Fix: ", 1)[1], msg


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_dict_config_names_the_key_and_fix(case):
    """The same checks for a config given as a dict (no file, so no line)."""
    _, body, _, key, problem, fix = case
    namespace: dict = {}
    exec(HEADER + body, namespace)
    values = {k: v for k, v in namespace.items() if not k.startswith("_") and k != "AMP_TYPE"}
    with pytest.raises(ConfigException) as e:
        load_config(values)
    msg = str(e.value)
    assert msg.startswith("<dict config>: ") and f"config key '{key}'" in msg and problem in msg and fix in msg, msg


def test_uppercase_names_are_never_rejected(tmp_path):
    path = _write(tmp_path, textwrap.dedent("""\
        GRADIENT_CLIPPING = 'anything'
        FP16 = 3
        FP_16 = None
        CLIP_GRAD = [1, 2]
        PARALLEL = dict(tensor=dict(size=8))
        ZERO = dict(model_config=dict())
        GRAD_ACCUMULATION = -1
        TORCH_DDP = True
        """))
    cfg = load_config(path)
    assert cfg.FP16 == 3 and cfg.PARALLEL.tensor.size == 8 and cfg.GRAD_ACCUMULATION == -1


def test_free_lowercase_hyper_parameters_are_accepted(tmp_path):
    path = _write(tmp_path, "seed = 42\nmodel = dict(depth=18)\noptimizer = dict(lr=0.1)\nbatch_size = 32\nlr = 0.1\n")
    cfg = load_config(path)
    assert cfg.model.depth == 18 and cfg.batch_size == 32


GOOD = textwrap.dedent("""\
    fp16 = dict(mode=AMP_TYPE.TORCH, init_scale=2.0**10, growth_interval=100)
    clip_grad_norm = 1.0
    gradient_accumulation = 2
    cudnn_benchmark = True
    cudnn_deterministic = False
    torch_ddp = dict(find_unused_parameters=True, broadcast_buffers=False)
    parallel = dict(data=2, pipeline=1, tensor=dict(size=1, mode=None))
    """)


def test_good_config_passes_and_keeps_values(tmp_path):
    cfg = load_config(_write(tmp_path, GOOD))
    assert cfg.gradient_accumulation == 2 and cfg.fp16.init_scale == 2.0**10
    assert cfg.parallel.tensor.size == 1


@pytest.mark.parametrize("fp16", [
    "dict(mode=None)", "None", "dict(mode=AMP_TYPE.BF16)", "dict(mode='torch')", "dict(mode='naive', hysteresis=3)",
    "dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16, growth_factor=2, backoff_factor=0.5, growth_interval=1000, "
    "hysteresis=2, min_scale=1, max_scale=2**24, dynamic_grad_scale=False, verbose=False)",
])
def test_every_precision_mode_is_accepted(tmp_path, fp16):
    load_config(_write(tmp_path, f"fp16 = {fp16}\n"))


@pytest.mark.parametrize("body", [
    "gradient_handler = [dict(type='DataParallelGradientHandler', bucket_size_mb=10)]\n",
    "gradient_handler = []\n",
    "zero = dict(stage=1)\n",
    "zero = dict(stage=3, offload_optimizer=True)\n",
    "clip_grad_norm = 0\n",
    "gradient_accumulation = 1\n",
    "dist_timeout = 30\n",
])
def test_other_good_values(tmp_path, body):
    load_config(_write(tmp_path, body))


def test_feature_dict_nested_in_another_dict_warns_with_file_line_key_and_fix(tmp_path):
    path = _write(tmp_path, textwrap.dedent("""\
        CONFIG = dict(
            fp16=dict(mode=AMP_TYPE.TORCH),
            gradient_accumulation=4,
            LR=0.1,
        )
        """))
    with pytest.warns(UserWarning) as record:
        cfg = load_config(path)
    messages = [str(w.message) for w in record]
    fp16 = next(m for m in messages if "'CONFIG.fp16'" in m)
    assert fp16.startswith(f"{path}:5: ") and "no effect" in fp16
    assert "Fix: move 'fp16' to the top level" in fp16
    accum = next(m for m in messages if "'CONFIG.gradient_accumulation'" in m)
    assert accum.startswith(f"{path}:6: ")
    assert not any("LR" in m for m in messages)
    assert "fp16" not in cfg  # the nested dict really does nothing: no top-level feature key


def test_nesting_warning_also_for_lowercase_dicts(tmp_path):
    path = _write(tmp_path, "train = dict(clip_grad_norm=1.0)\n")
    with pytest.warns(UserWarning, match=r"'train.clip_grad_norm'.*move 'clip_grad_norm' to the top level"):
        load_config(path)


def test_no_warning_for_a_clean_config(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(_write(tmp_path, GOOD))


def test_validate_config_checks_every_known_feature_key():
    # each key in FEATURE_KEYS has a check: a value of a clearly wrong type is rejected for every one
    for key in FEATURE_KEYS:
        with pytest.raises(ConfigException, match=f"config key '{key}"):
            validate_config(Config({key: object()}))


def test_load_config_types():
    assert load_config(None) == {}
    assert isinstance(load_config({"A": 1}), Config)
    with pytest.raises(TypeError, match="path to a .py file, a dict or a Config"):
        load_config(3)


@pytest.mark.parametrize("config,needle", [
    (dict(zero=dict(stage=2), fp16=dict(mode="naive")), "AMP_TYPE.NAIVE keeps fp16 weights"),
    (dict(zero=dict(stage=1), gradient_handler=[dict(type="DataParallelGradientHandler")]), "ZeRO reduces gradients itself"),
    (dict(zero=dict(stage=1, offload_optimizer=True)), "are FSDP2 options, but stage 1"),
    (dict(zero=dict(stage=3), gradient_accumulation="auto"), "FSDP2 runs collectives inside forward and backward"),
    (dict(zero=dict(stage=2), torch_ddp=dict(find_unused_parameters=True)), "FSDP2 replaces DDP"),
])
def test_zero_combinations_that_cannot_work(config, needle):
    with pytest.raises(ConfigException) as e:
        validate_config(Config(config))
    assert needle in str(e.value) and "Fix:" in str(e.value)
