"""Every bad config fails before launch with a message naming the file, the line, the key and the fix."""
import re
import textwrap
import warnings
from pathlib import Path

import pytest

from colossal_lite.context import Config, ConfigException, ForeignConfigKeyWarning
from colossal_lite.context.validation import FEATURE_KEYS, FOREIGN_KEYS, validate_config
from colossal_lite.initialize import _engine_config
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
    # NaN passes every bound check (clipping turned off in silence) and inf is no setting (found by a probe)
    ("clip-nan", "clip_grad_norm = float('nan')\n", 4, "clip_grad_norm", "got nan", "clip_grad_norm = 1.0"),
    ("clip-inf", "clip_grad_norm = float('inf')\n", 4, "clip_grad_norm", "got inf", "clip_grad_norm = 1.0"),
    ("fp16-nan-scale", "fp16 = dict(mode=AMP_TYPE.TORCH, init_scale=float('nan'))\n", 4, "fp16.init_scale", "got nan",
     "init_scale=65536.0"),
    ("dist-timeout-nan", "dist_timeout = float('nan')\n", 4, "dist_timeout", "seconds > 0", "dist_timeout = "),
    # gradient_accumulation
    ("accum-zero", "gradient_accumulation = 0\n", 4, "gradient_accumulation", "positive int", "write gradient_accumulation = 1"),
    ("accum-float", "gradient_accumulation = 2.5\n", 4, "gradient_accumulation", "positive int",
     "write e.g. gradient_accumulation = 4"),
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
     "gradient_handler = [dict(type='DataParallelGradientHandler', bucket_size_mb=10)]"),
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
    ("zero-stage", "zero = dict(stage=4)\n", 4, "zero.stage", "expected 1, 2 or 3", "write e.g. zero = dict(stage=2)"),
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
    # the fix shows the value the user meant when it can be told from the value written
    ("accum-string", "gradient_accumulation = '8'\n", 4, "gradient_accumulation", "got '8'", "write gradient_accumulation = 8"),
    ("accum-whole-float", "gradient_accumulation = 8.0\n", 4, "gradient_accumulation", "got 8.0",
     "write gradient_accumulation = 8"),
    ("accum-auto-case", "gradient_accumulation = 'Auto'\n", 4, "gradient_accumulation", "got 'Auto'",
     "write gradient_accumulation = 'auto'"),
    ("fp16-string-mode", "fp16 = 'bf16'\n", 4, "fp16", "expected a dict", "write fp16 = dict(mode=AMP_TYPE.BF16)"),
    ("fp16-enum-mode", "fp16 = AMP_TYPE.NAIVE\n", 4, "fp16", "expected a dict", "write fp16 = dict(mode=AMP_TYPE.NAIVE)"),
    ("fp16-false", "fp16 = False\n", 4, "fp16", "expected a dict", "write fp16 = None (fp32)"),
    ("fp16-no-mode-naive-options", "fp16 = dict(initial_scale=1024.0, hysteresis=3)\n", 4, "fp16", "missing 'mode'",
     "write fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=1024.0, hysteresis=3)"),
    ("fp16-mode-synonym", "fp16 = dict(mode='bfloat16')\n", 4, "fp16.mode", "unknown precision mode 'bfloat16'",
     "write mode=AMP_TYPE.BF16"),
    ("fp16-mode-misspelt", "fp16 = dict(mode='nave')\n", 4, "fp16.mode", "unknown precision mode 'nave'",
     "write mode=AMP_TYPE.NAIVE"),
    ("fp16-apex-O2", "fp16 = dict(mode=AMP_TYPE.APEX, opt_level='O2')\n", 4, "fp16.mode", "apex",
     "write mode=AMP_TYPE.NAIVE"),
    ("fp16-option-of-naive", "fp16 = dict(mode=AMP_TYPE.TORCH, hysteresis=2)\n", 4, "fp16.hysteresis",
     "not an option of mode TORCH", "'hysteresis' is an option of mode=AMP_TYPE.NAIVE"),
    ("fp16-bool-word", "fp16 = dict(mode=AMP_TYPE.TORCH, enabled='False')\n", 4, "fp16.enabled", "True or False",
     "write enabled=False"),
    ("fp16-interval-string", "fp16 = dict(mode=AMP_TYPE.TORCH, growth_interval='500')\n", 4, "fp16.growth_interval",
     "positive int", "write growth_interval=500"),
    ("fp16-scale-string", "fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale='1024')\n", 4, "fp16.initial_scale",
     "positive number", "write initial_scale=1024"),
    ("fp16-backoff-inverted", "fp16 = dict(mode=AMP_TYPE.TORCH, backoff_factor=4)\n", 4, "fp16.backoff_factor",
     "between 0 and 1", "write backoff_factor=0.25"),
    ("fp16-growth-inverted", "fp16 = dict(mode=AMP_TYPE.TORCH, growth_factor=0.25)\n", 4, "fp16.growth_factor",
     "must be > 1", "write growth_factor=4.0"),
    # naive fp16's scaler multiplies by the same factors as torch's; its bounds must hold the scale (legacy asserted
    # both), and a factor of 1 or less shrank the scale after good steps (found by the config probe)
    ("naive-growth-inverted", "fp16 = dict(mode=AMP_TYPE.NAIVE, growth_factor=0.5)\n", 4, "fp16.growth_factor",
     "must be > 1", "write growth_factor=2.0"),
    ("naive-growth-one", "fp16 = dict(mode=AMP_TYPE.NAIVE, growth_factor=1)\n", 4, "fp16.growth_factor",
     "must be > 1", "write e.g. growth_factor=2.0"),
    ("naive-bounds-swapped", "fp16 = dict(mode=AMP_TYPE.NAIVE,\n           min_scale=1024.0, max_scale=2.0)\n", 5,
     "fp16.min_scale", "is 1024.0, above max_scale=2.0", "swap them: write min_scale=2.0, max_scale=1024.0"),
    ("naive-initial-below-min", "fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=1.0, min_scale=4.0)\n", 4,
     "fp16.initial_scale", "is 1.0, below min_scale=4.0", "write initial_scale=4.0 (or change min_scale)"),
    ("naive-default-initial-above-max", "fp16 = dict(mode=AMP_TYPE.NAIVE,\n           max_scale=1024.0)\n", 5,
     "fp16.max_scale", "initial_scale is 65536.0 (its default), above it", "add initial_scale=1024.0"),
    # a feature key inside fp16 does nothing there: "remove it" dropped the clipping (found by the config probe)
    ("fp16-clip-in-torch", "fp16 = dict(mode=AMP_TYPE.TORCH, clip_grad_norm=1.0)\n", 4, "fp16.clip_grad_norm",
     "is a top-level config key, not an option of mode TORCH",
     "move it to the top level of the config file: clip_grad_norm = 1.0"),
    ("fp16-clip-in-bf16", "fp16 = dict(mode=AMP_TYPE.BF16, clip_grad_norm=0.5)\n", 4, "fp16.clip_grad_norm",
     "not an option of mode BF16", "clip_grad_norm = 0.5"),
    ("fp16-accumulation-in-naive", "fp16 = dict(mode=AMP_TYPE.NAIVE, gradient_accumulation=4)\n", 4,
     "fp16.gradient_accumulation", "is a top-level config key", "move it to the top level of the config file: "
     "gradient_accumulation = 4"),
    ("fp16-clip-set-twice", "clip_grad_norm = 2.0\nfp16 = dict(mode=AMP_TYPE.TORCH, clip_grad_norm=1.0)\n", 5,
     "fp16.clip_grad_norm", "is a top-level config key", "remove it here: the top-level clip_grad_norm = 2.0 is the one"),
    ("clip-string-value", "clip_grad_norm = '0.5'\n", 4, "clip_grad_norm", "got '0.5'", "write clip_grad_norm = 0.5"),
    ("cudnn-int-false", "cudnn_benchmark = 0\n", 4, "cudnn_benchmark", "True or False", "write cudnn_benchmark = False"),
    ("cudnn-word-false", "cudnn_deterministic = 'no'\n", 4, "cudnn_deterministic", "True or False",
     "write cudnn_deterministic = False"),
    ("handler-dict-options", "gradient_handler = dict(type='DataParallelGradientHandler', bucket_size_mb=8)\n", 4,
     "gradient_handler", "got a single dict", "write gradient_handler = [dict(type='DataParallelGradientHandler', bucket_size_mb=8)]"),
    ("handler-name", "gradient_handler = ['DataParallelGradientHandler']\n", 4, "gradient_handler", "with a 'type'",
     "write gradient_handler = [dict(type='DataParallelGradientHandler')]"),
    ("handler-misspelt", "gradient_handler = [dict(type='DataParalelGradientHandler')]\n", 4, "gradient_handler",
     "unknown handler type", "did you mean 'DataParallelGradientHandler'"),
    ("zero-int", "zero = 3\n", 4, "zero", "expected a dict", "write zero = dict(stage=3)"),
    # True == 1 and 2.0 == 2 passed the stage check (found by the config probe)
    ("zero-stage-bool", "zero = dict(stage=True)\n", 4, "zero.stage", "expected 1, 2 or 3, got True",
     "write e.g. zero = dict(stage=2)"),
    ("zero-stage-float", "zero = dict(stage=2.0, offload_optimizer=True)\n", 4, "zero.stage", "got 2.0",
     "write zero = dict(stage=2, offload_optimizer=True)"),
    ("zero-level-float", "zero = dict(level=3.0)\n", 4, "zero.level", "got 3.0", "write zero = dict(stage=3)"),
    ("parallel-size-string", "parallel = dict(tensor=dict(\n    size='1'))\n", 5, "parallel.tensor.size",
     "expected the int 1 (no tensor parallelism) or None, got '1'", "remove parallel.tensor"),
    ("parallel-size-bool", "parallel = dict(pipeline=True)\n", 4, "parallel.pipeline", "got True",
     "remove parallel.pipeline"),
    ("parallel-size-float", "parallel = dict(pipeline=1.0)\n", 4, "parallel.pipeline", "got 1.0",
     "remove parallel.pipeline"),
    ("parallel-size-whole-float", "parallel = dict(pipeline=dict(size=2.0))\n", 4, "parallel.pipeline",
     "pipeline parallelism (size 2.0) is not supported", "remove parallel.pipeline"),
    ("zero-stage-string", "zero = dict(stage='3', offload_optimizer=True)\n", 4, "zero.stage", "got '3'",
     "write zero = dict(stage=3, offload_optimizer=True)"),
    ("dist-timeout-string", "dist_timeout = '600'\n", 4, "dist_timeout", "got '600'", "write dist_timeout = 600"),
    ("micro-batch-string", "micro_batch_size = '16'\n", 4, "micro_batch_size", "positive int", "write micro_batch_size = 16"),
    ("global-batch-float", "global_batch_size = 64.0\n", 4, "global_batch_size", "positive int",
     "write global_batch_size = 64"),
    ("micro-batch-zero", "micro_batch_size = 0\n", 4, "micro_batch_size", "positive int", "write e.g. micro_batch_size = 32"),
    ("grad-reduction-case", "grad_reduction = 'Sum'\n", 4, "grad_reduction", "got 'Sum'", "write grad_reduction = 'sum'"),
    ("grad-reduction-avg", "grad_reduction = 'avg'\n", 4, "grad_reduction", "got 'avg'", "write grad_reduction = 'mean'"),
    ("grad-reduction-underscores", "grad_reduction = 'per_token_mean'\n", 4, "grad_reduction", "got 'per_token_mean'",
     "write grad_reduction = 'per-token-mean'"),
    ("compile-mode-string", "compile = 'max-autotune'\n", 4, "compile", "expected True/False or a dict",
     "write compile = dict(mode='max-autotune')"),
    ("compile-int", "compile = 1\n", 4, "compile", "expected True/False or a dict", "write compile = True"),
    ("compile-option", "compile = dict(mod='default')\n", 4, "compile.mod", "not an option of torch.compile",
     "did you mean 'mode'"),
    # nonfinite_loss
    ("nonfinite-unknown", "nonfinite_loss = 'warn'\n", 4, "nonfinite_loss", "expected 'raise', 'skip' or 'ignore'",
     "write e.g. nonfinite_loss = 'raise'"),
    ("nonfinite-case", "nonfinite_loss = 'Skip'\n", 4, "nonfinite_loss", "got 'Skip'", "write nonfinite_loss = 'skip'"),
    ("nonfinite-error", "nonfinite_loss = 'error'\n", 4, "nonfinite_loss", "got 'error'", "write nonfinite_loss = 'raise'"),
    ("nonfinite-bool", "nonfinite_loss = True\n", 4, "nonfinite_loss", "got True", "write e.g. nonfinite_loss = 'raise'"),
    # mixed-case names of feature keys: meant as the feature, so refused like a misspelling
    ("mixed-clip", "Clip_Grad_Norm = 1.0\n", 4, "Clip_Grad_Norm", "feature keys are lowercase",
     "rename it to 'clip_grad_norm' (or write CLIP_GRAD_NORM in UPPERCASE"),
    ("mixed-accum", "Gradient_Accumulation = 4\n", 4, "Gradient_Accumulation", "feature keys are lowercase",
     "rename it to 'gradient_accumulation'"),
    ("mixed-fp16", "Fp16 = dict(mode=AMP_TYPE.TORCH)\n", 4, "Fp16", "feature keys are lowercase", "rename it to 'fp16'"),
    ("mixed-camel", "ClipGradNorm = 1.0\n", 4, "ClipGradNorm", "feature keys are lowercase", "rename it to 'clip_grad_norm'"),
    ("mixed-alias", "Gradient_Clipping = 1.0\n", 4, "Gradient_Clipping", "feature keys are lowercase",
     "rename it to 'clip_grad_norm'"),
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


@pytest.mark.parametrize("package", [False, True], ids=["sibling-file", "sibling-package"])
@pytest.mark.parametrize("case", BAD_CONFIGS[:6] + BAD_CONFIGS[-3:], ids=[c[0] for c in BAD_CONFIGS[:6] + BAD_CONFIGS[-3:]])
def test_a_bad_key_from_a_base_config_is_named_at_its_line_there(tmp_path, case, package):
    """``from base_config import *`` in the config: the message named config.py with no line (found by a probe)."""
    _, body, line, key, problem, fix = case
    folder = tmp_path / "cfgpkg" if package else tmp_path
    folder.mkdir(exist_ok=True)
    if package:
        (folder / "__init__.py").write_text("")
    base = _write(folder, body, "base_config.py")
    path = tmp_path / "config.py"
    path.write_text(f"from {'cfgpkg.' if package else ''}base_config import *\nNUM_EPOCHS = 4\n")
    with pytest.raises(ConfigException) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{base}:{line}: "), msg
    assert f"config key '{key}'" in msg and problem in msg and fix in msg.split("Fix: ", 1)[1], msg


def test_a_key_the_config_sets_again_is_named_in_the_config_not_its_base(tmp_path):
    (tmp_path / "base_config.py").write_text("clip_grad_norm = 1.0\ngradient_accumulation = 2\n")
    path = tmp_path / "config.py"
    path.write_text("from base_config import *\nclip_grad_norm = -1.0\n")
    with pytest.raises(ConfigException, match=f"^{path}:2: config key 'clip_grad_norm'"):
        load_config(path)


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


def test_mixed_case_names_that_mean_no_feature_key_are_the_users_own(tmp_path):
    path = _write(tmp_path, "Model = dict(depth=18)\nlearningRate = 0.1\nTrain_Config = dict(LR=0.1)\n")
    cfg = load_config(path)
    assert cfg.Model.depth == 18 and cfg.learningRate == 0.1


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


@pytest.mark.parametrize("body, key, meant", [
    # the suggestion carries the user's own value over (it said gradient_accumulation = 4 to accum_steps = 3)
    ("bf16 = True\n", "bf16", "fp16 = dict(mode=AMP_TYPE.BF16)"),
    ("bf16 = False\n", "bf16", "fp16 = None"),
    ("use_fp16 = True\n", "use_fp16", "fp16 = dict(mode=AMP_TYPE.TORCH)"),
    ("fp16_mode = 'bf16'\n", "fp16_mode", "fp16 = dict(mode=AMP_TYPE.BF16)"),
    ("fp16_opt_level = 'O0'\n", "fp16_opt_level", "fp16 = None"),
    ("zero_optimization = dict(stage=3, offload_optimizer=None)\n", "zero_optimization", "zero = dict(stage=3)"),
    ("zero_stage = 1\n", "zero_stage", "zero = dict(stage=1)"),
    ("zero_stage = 0\n", "zero_stage", "zero = None"),
    ("gradient_clip_val = 0.5\n", "gradient_clip_val", "clip_grad_norm = 0.5"),
    ("max_norm = 2\n", "max_norm", "clip_grad_norm = 2"),
    ("accum_steps = 3\n", "accum_steps", "gradient_accumulation = 3"),
    ("find_unused_parameters = False\n", "find_unused_parameters", "torch_ddp = dict(find_unused_parameters=False)"),
    ("bucket_cap_mb = 50\n", "bucket_cap_mb", "torch_ddp = dict(bucket_cap_mb=50)"),
    ("static_graph = True\n", "static_graph", "torch_ddp = dict(static_graph=True)"),
    ("torch_compile = False\n", "torch_compile", "compile = False"),
    # a value that says nothing colossal_lite can write: the stock line, as an example
    ("accum_steps = 2.5\n", "accum_steps", "e.g. gradient_accumulation = 4"),
    ("zero_stage = 5\n", "zero_stage", "e.g. zero = dict(stage=2)"),
])
def test_another_frameworks_name_for_a_feature_is_kept_with_a_warning(tmp_path, body, key, meant):
    """Such a name switched nothing on without a word; it stays the user's own value (found by the config probe)."""
    path = _write(tmp_path, body)
    with pytest.warns(ForeignConfigKeyWarning) as record:
        cfg = load_config(path)
    assert key in cfg  # kept, as every other lowercase name is
    assert [str(w.message) for w in record] == [
        f"{path}:4: config key '{key}' is not a colossal_lite option (kept as your own value); colossal_lite's is "
        f"{meant}. Fix: write that instead, or, if '{key}' is your own value, write it in UPPERCASE or filter "
        f"ForeignConfigKeyWarning (from colossal_lite.context)"]


@pytest.mark.parametrize("key, value", [
    ("bf16", True), ("bf16", False), ("use_fp16", 1), ("half", True), ("fp16_mode", "bf16"), ("fp16_opt_level", "O2"),
    ("zero_stage", 2), ("zero_stage", 0), ("zero_optimization", dict(stage=3)), ("gradient_clip_val", 0),
    ("clip_norm", "1.5"), ("accum_steps", "8"), ("gradient_as_bucket_view", True), ("bucket_cap_mb", 12.5),
    ("torch_compile", True),
])
def test_the_foreign_names_suggestion_is_a_config_line_colossal_lite_takes(tmp_path, key, value):
    """What the warning says to write, with the user's value in it, is itself a valid config."""
    with pytest.warns(ForeignConfigKeyWarning) as record:
        load_config({key: value})
    line = re.search(r"colossal_lite's is (.*)\. Fix:", str(record[0].message)).group(1)
    assert not line.startswith("e.g."), line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(_write(tmp_path, f"{line}\n"))


def test_the_foreign_name_warning_can_be_filtered_and_is_a_user_warning(tmp_path):
    assert issubclass(ForeignConfigKeyWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=ForeignConfigKeyWarning)
        assert load_config(_write(tmp_path, "bf16 = True\nBF16_RUN = True\n")).bf16 is True


def test_the_foreign_name_warning_is_not_said_again_by_an_engines_own_config(tmp_path):
    """``initialize(config=dict(...))`` checks the launch config with its overrides again: the foreign name was
    already said with the file's line, and was said a second time as ``<dict config>`` (found by a probe)."""
    with pytest.warns(ForeignConfigKeyWarning):
        launch_config = load_config(_write(tmp_path, "bf16 = True\n"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignConfigKeyWarning)
        merged = _engine_config(launch_config, dict(clip_grad_norm=1.0))
    assert merged.bf16 is True and merged.clip_grad_norm == 1.0


def test_the_foreign_name_warning_is_said_by_rank_0_only(tmp_path, monkeypatch):
    """Every rank checks the config as it launches, before the process group exists: torchrun's RANK says which
    one speaks (two ranks printed the warning twice; found by the output probe)."""
    path = _write(tmp_path, "bf16 = True\n")
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignConfigKeyWarning)
        assert load_config(path).bf16 is True
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(ForeignConfigKeyWarning):
        load_config(path)


def test_every_foreign_name_is_a_name_the_checker_keeps():
    """A name of the table that the checker refused as a near-miss would never reach the warning."""
    for key in FOREIGN_KEYS:
        with pytest.warns(ForeignConfigKeyWarning, match=f"config key '{key}'"):
            load_config({key: 1})


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
