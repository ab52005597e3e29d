"""``--set KEY=VALUE`` config overrides: parsing, applying, the errors that name them, ``launch_from_torch`` under
torchrun with the parser's ``--set``, ``colossal-lite check --set`` and the docs' example."""
import json
import re

import pytest
from dist_helpers import doc_python_blocks, run_ranks

import colossal_lite
from colossal_lite.cli import main as cli_main
from colossal_lite.context import Config, ConfigException
from colossal_lite.context.features import describe_features
from colossal_lite.context.overrides import apply_overrides, parse_override
from colossal_lite.context.validation import load_config

CONFIG = "BATCH_SIZE = 8\nclip_grad_norm = 1.0\nfp16 = None\nzero = dict(\n    stage=2,\n)\n"


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.py"
    path.write_text(CONFIG)
    return path


@pytest.mark.parametrize("text, path, value", [
    ("BATCH_SIZE=64", ("BATCH_SIZE",), 64),
    ("zero.stage=2", ("zero", "stage"), 2),
    ("fp16.mode=bf16", ("fp16", "mode"), "bf16"),               # not a literal: the plain string
    ("clip_grad_norm=1e-1", ("clip_grad_norm",), 0.1),
    ("torch_ddp.find_unused_parameters=True", ("torch_ddp", "find_unused_parameters"), True),
    ("fp16=None", ("fp16",), None),
    ("MILESTONES=[200, 500]", ("MILESTONES",), [200, 500]),
    ("NAME='a=b'", ("NAME",), "a=b"),                           # only the first '=' splits
    ("NAME=two words", ("NAME",), "two words"),
    (" LR = 0.5 ", ("LR",), 0.5),
    ("EMPTY=", ("EMPTY",), ""),
])
def test_parse_override_reads_dotted_keys_and_literals(text, path, value):
    assert parse_override(text) == (path, value)


def test_overrides_set_dotted_keys_in_order_and_leave_the_given_config_alone(config_file):
    original = Config.from_file(config_file)
    config = load_config(original, ["fp16.mode=bf16", "zero.stage=3", "BATCH_SIZE=64", "BATCH_SIZE=128",
                                    "zero.offload_optimizer=True"])
    assert config.BATCH_SIZE == 128                                   # a later override wins
    assert config.fp16 == {"mode": "bf16"} and config.fp16.mode == "bf16"  # a None value became a dict
    assert config.zero == {"stage": 3, "offload_optimizer": True}     # the file's dict, changed key by key
    assert load_config({}, ["torch_ddp.find_unused_parameters=True"]).torch_ddp == {"find_unused_parameters": True}
    assert config.clip_grad_norm == 1.0
    assert original.BATCH_SIZE == 8 and original.zero == {"stage": 2} and original.fp16 is None
    assert load_config(original, []) == original and apply_overrides(original, None) is original


def test_a_misspelt_override_is_refused_naming_the_override(config_file):
    with pytest.raises(ConfigException) as e:
        load_config(str(config_file), ["clip_grad_nrom=1.0"])
    assert str(e.value).startswith("--set clip_grad_nrom=1.0: config key 'clip_grad_nrom': is not a colossal_lite "
                                   "config key"), e.value
    assert "rename it to 'clip_grad_norm'" in str(e.value)


def test_a_bad_override_value_is_refused_like_a_config_line(config_file):
    with pytest.raises(ConfigException, match=r"^--set fp16\.mode=bf17: config key 'fp16\.mode': unknown precision "
                                              r"mode 'bf17'\. Fix: write --set fp16\.mode=bf16$"):
        load_config(config_file, ["fp16.mode=bf17"])
    with pytest.raises(ConfigException, match=r"^--set zero\.stage=0: config key 'zero\.stage'"):
        load_config({"zero": {"stage": 2}}, ["zero.stage=0"])
    # a key of the file made wrong by overrides inside it names the line and the overrides
    with pytest.raises(ConfigException) as e:
        load_config(config_file, ["zero.stage=1", "zero.offload_optimizer=True"])
    assert str(e.value).startswith(f"{config_file}:4 (with --set zero.stage=1, --set zero.offload_optimizer=True): "
                                   f"config key 'zero'"), e.value
    # the file's own mistakes keep their line
    path = config_file.parent / "bad.py"
    path.write_text("BATCH_SIZE = 8\ngradient_clipping = 1.0\n")
    with pytest.raises(ConfigException, match=rf"^{re.escape(str(path))}:2: config key 'gradient_clipping'"):
        load_config(path, ["BATCH_SIZE=16"])


LEGACY_ZERO = "BATCH_SIZE = 8\nzero = dict(\n    level=2,\n    cpu_offload=True,\n)\n"


@pytest.mark.parametrize("override, key, working, zero", [
    ("zero.stage=3", "zero.level", "zero.level=3", {"stage": 3, "offload_optimizer": True}),
    ("zero.offload_optimizer=False", "zero.cpu_offload", "zero.cpu_offload=False", {"stage": 2}),
])
def test_an_override_of_a_legacy_zero_key_names_itself_and_the_override_that_works(tmp_path, override, key, working,
                                                                                   zero):
    """"remove 'level'" named only the file's line, and no command line can remove a key of the file."""
    path = tmp_path / "legacy.py"
    path.write_text(LEGACY_ZERO)
    with pytest.raises(ConfigException) as e:
        load_config(path, [override])
    message = str(e.value)
    assert message.startswith(f"{path}:2 (with --set {override}): config key '{key}': "), message
    assert message.endswith(f"Fix: write --set {working} instead (the name the config uses)"), message
    assert load_config(path, [working]).zero == zero


@pytest.mark.parametrize("key", ["zero", "torch_ddp", "gradient_handler", "compile", "clip_grad_norm",
                                 "gradient_accumulation", "cudnn_benchmark", "dist_timeout", "micro_batch_size",
                                 "grad_reduction", "nonfinite_loss", "parallel"])
def test_set_none_takes_a_feature_key_away_as_initialize_does(key):
    """``initialize(config=dict(zero=None))`` takes the key away; ``--set zero=None`` was refused for all but fp16."""
    given = {"zero": {"stage": 1}, "torch_ddp": {"bucket_cap_mb": 10}, "clip_grad_norm": 1.0, "parallel": {"data": 2}}
    config = load_config(given, [f"{key}=None"])
    assert key not in config and {k: v for k, v in given.items() if k != key}.items() <= config.items()


def test_none_written_in_a_file_takes_the_key_away_as_set_does(tmp_path):
    """``zero = None`` in the file means what ``--set zero=None`` and ``dict(zero=None)`` mean: ZeRO off."""
    path = tmp_path / "config.py"
    path.write_text("zero = None\nclip_grad_norm = None\ngradient_accumulation = None\nfp16 = None\n")
    config = load_config(path)
    assert dict(config) == {"fp16": None}
    assert "ZeRO" not in "\n".join(describe_features(config))


@pytest.mark.parametrize("text, message", [
    ("zero", r"^--set zero: no '=' in the override\. Fix: write --set KEY=VALUE"),
    ("=1", r"^--set =1: the key '' has an empty part"),
    ("fp16..mode=bf16", r"^--set fp16\.\.mode=bf16: the key 'fp16\.\.mode' has an empty part"),
    (".stage=2", r"^--set \.stage=2: the key '\.stage' has an empty part"),
    ("clip_grad_norm.max=1", r"^--set clip_grad_norm\.max=1: cannot set 'clip_grad_norm\.max' because "
                             r"'clip_grad_norm' is float 1\.0, not a dict\. Fix: set 'clip_grad_norm' itself"),
    ("zero.stage.x=1", r"^--set zero\.stage\.x=1: cannot set 'zero\.stage\.x' because 'zero\.stage' is int 2"),
])
def test_malformed_overrides_are_refused(config_file, text, message):
    with pytest.raises(ConfigException, match=message):
        load_config(config_file, [text])


def test_the_default_parser_collects_repeated_set():
    parser = colossal_lite.get_default_parser()
    args = parser.parse_args(["--config", "c.py", "--set", "zero.stage=2", "--set", "BATCH_SIZE=64"])
    assert args.set == ["zero.stage=2", "BATCH_SIZE=64"]
    assert parser.parse_args([]).set == []


LAUNCH_SCRIPT = """\
import json
import colossal_lite
from colossal_lite.core import global_context as gpc

args = colossal_lite.get_default_parser().parse_args()
colossal_lite.launch_from_torch(config=args.config, overrides=args.set, verbose=False)
seen = dict(rank=gpc.get_global_rank(), world=gpc.get_world_size(), BATCH_SIZE=gpc.config.BATCH_SIZE,
            fp16=dict(gpc.config.fp16), zero=dict(gpc.config.zero), clip=gpc.config.clip_grad_norm)
print("SEEN " + json.dumps(seen) + "\\n", end="", flush=True)  # one write: the ranks' lines never mix
"""


def test_launch_from_torch_applies_the_parsers_set_on_every_rank(tmp_path, config_file):
    script = tmp_path / "train.py"
    script.write_text(LAUNCH_SCRIPT)
    proc = run_ranks(script, ["--config", config_file, "--set", "fp16.mode=bf16", "--set", "zero.stage=1",
                                 "--set", "BATCH_SIZE=64"], nproc=2, cwd=tmp_path)
    seen = sorted((json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("SEEN ")),
                  key=lambda s: s["rank"])
    assert [s["rank"] for s in seen] == [0, 1], proc.stdout
    for s in seen:
        assert (s["world"], s["BATCH_SIZE"], s["fp16"], s["zero"], s["clip"]) == (2, 64, {"mode": "bf16"},
                                                                                  {"stage": 1}, 1.0)


def test_launch_from_torch_refuses_a_misspelt_override_before_starting(tmp_path, config_file):
    script = tmp_path / "train.py"
    script.write_text(LAUNCH_SCRIPT)
    proc = run_ranks(script, ["--config", config_file, "--set", "clip_grad_nrom=1.0"], nproc=2, cwd=tmp_path,
                        check=False)
    assert proc.returncode != 0
    assert "--set clip_grad_nrom=1.0: config key 'clip_grad_nrom'" in proc.stderr, proc.stderr[-3000:]
    assert "SEEN" not in proc.stdout


def run_cli(capsys, *args):
    """``colossal-lite ARGS`` in this process: (exit status, stdout, stderr)."""
    status = cli_main([str(a) for a in args])
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def test_cli_check_shows_the_overridden_config(config_file, capsys):
    status, out, err = run_cli(capsys, "check", config_file, "--set", "fp16.mode=bf16", "--set",
                               "gradient_accumulation=4", "--set", "BATCH_SIZE=64")
    assert status == 0, err
    assert out.startswith(f"{config_file} --set fp16.mode=bf16 --set gradient_accumulation=4 --set BATCH_SIZE=64: OK")
    assert "precision: bf16 autocast" in out
    assert "gradient accumulation: 4 micro-batches per optimizer step" in out
    assert "your own values: BATCH_SIZE=64" in out

    status, out, err = run_cli(capsys, "check", config_file, "--set", "clip_grad_nrom=1.0")
    assert status == 1 and out == ""
    assert err.startswith("error: --set clip_grad_nrom=1.0: config key 'clip_grad_nrom'"), err
    assert "Traceback" not in err
    status, _, err = run_cli(capsys, "check", config_file, "--set", "zero")
    assert status == 1 and err.startswith("error: --set zero: no '='"), err


def test_the_docs_example_runs_on_two_ranks(tmp_path, config_file):
    snippet = doc_python_blocks("docs/config.md", "Overriding from the command line")[0]
    (tmp_path / "train.py").write_text(snippet)
    proc = run_ranks(tmp_path / "train.py", ["--config", config_file, "--set", "fp16.mode=bf16",
                                             "--set", "BATCH_SIZE=64"], nproc=2, cwd=tmp_path)
    for rank in (0, 1):
        assert f"rank {rank}: BATCH_SIZE=64 fp16={{'mode': 'bf16'}}" in proc.stdout, proc.stdout
