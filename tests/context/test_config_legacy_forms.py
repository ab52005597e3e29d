"""Legacy config forms of the Colossal-AI docs and examples: ``fp16=dict(mode=AMP_TYPE.NAIVE,
log_num_zeros_in_grad=...)`` is accepted and, when true, rank 0 logs the zero gradient elements of each update;
``verbose=True`` logs each change of the loss scale;
``zero=dict(level=..., cpu_offload=...)`` is read in today's names; ``gradient_clipping`` (a silent no-op in
legacy) stays refused with its fix."""
import textwrap

import pytest
import torch
from dist_helpers import run_python, run_ranks

from colossal_lite.context import ConfigException
from colossal_lite.launch import load_config

HEADER = "from colossal_lite.amp import AMP_TYPE\nBATCH_SIZE = 8\n"  # the case starts on line 3


def _write(tmp_path, body):
    path = tmp_path / "config.py"
    path.write_text(HEADER + body)
    return path


@pytest.mark.parametrize("body", [
    "fp16 = dict(mode=AMP_TYPE.NAIVE, log_num_zeros_in_grad=True)\n",
    "fp16 = dict(mode=AMP_TYPE.NAIVE, log_num_zeros_in_grad=False, initial_scale=2**16, min_scale=1)\n",
    "fp16 = dict(mode=AMP_TYPE.NAIVE, log_num_zeros_in_grad=False)\nzero = dict(level=1, cpu_offload=False)\n",
    "zero = dict(level=2, cpu_offload=True)\n",
])
def test_legacy_forms_are_accepted(tmp_path, body):
    cfg = load_config(_write(tmp_path, body))
    if "fp16" in cfg:
        assert cfg.fp16.log_num_zeros_in_grad in (True, False)
    if "zero" in cfg:
        assert cfg.zero.stage in (1, 2)


@pytest.mark.parametrize("body,key,problem,fix", [
    ("fp16 = dict(mode=AMP_TYPE.NAIVE, log_num_zeros_in_grad='yes')\n", "fp16.log_num_zeros_in_grad",
     "expected True or False", "write log_num_zeros_in_grad=True"),
    ("fp16 = dict(mode=AMP_TYPE.TORCH, log_num_zeros_in_grad=True)\n", "fp16.log_num_zeros_in_grad",
     "not an option of mode TORCH", "'log_num_zeros_in_grad' is an option of mode=AMP_TYPE.NAIVE"),
    ("gradient_clipping = 1.0\n", "gradient_clipping", "silently ignored", "rename it to 'clip_grad_norm'"),
])
def test_wrong_or_silent_forms_are_refused_with_the_fix(tmp_path, body, key, problem, fix):
    path = _write(tmp_path, body)
    with pytest.raises(ConfigException) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}:3: config key '{key}': ")
    problem_part, fix_part = message.split(". Fix: ")
    assert problem in problem_part and fix in fix_part


# A Linear layer fed inputs whose features 1 and 3 are always 0: the weight gradient's columns 1 and 3 are
# exactly zero (3 outputs x 2 columns = 6 zeros) and every other of its 15 elements (12 weights + 3 biases) is not.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import colossal_lite
    from colossal_lite.amp import AMP_TYPE

    log = sys.argv[1] == "on"
    colossal_lite.launch_from_torch(config=dict(fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=2.0**8,
                                                         log_num_zeros_in_grad=log)),
                                    seed=0, verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = colossal_lite.initialize(model, opt, torch.nn.MSELoss(), verbose=False)
    g = torch.Generator().manual_seed(1 + colossal_lite.core.global_context.get_global_rank())
    for step in range(3):
        x = torch.rand(8, 4, generator=g) + 0.5
        x[:, 1] = 0
        x[:, 3] = 0
        y = torch.rand(8, 3, generator=g) + 2.0
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        assert engine.step()
        print(f"rank {colossal_lite.core.global_context.get_global_rank()} step {step} done\\n", end="",
              flush=True)  # one write: the ranks' lines never mix
""")


def _expected_zeros():
    """The count the hand-written fp32 gradient gives: elements of weight and bias grads equal to 0."""
    model = torch.nn.Linear(4, 3)
    x = torch.ones(2, 4)
    x[:, 1] = 0
    x[:, 3] = 0
    torch.nn.functional.mse_loss(model(x), torch.full((2, 3), 2.0)).backward()
    zeros = sum(int((p.grad == 0).sum()) for p in model.parameters())
    return zeros, sum(p.numel() for p in model.parameters())


def test_zero_count_is_logged_at_each_update_when_asked(tmp_path):
    script = tmp_path / "naive.py"
    script.write_text(SCRIPT)
    out = run_python(script, ["on"], timeout=120).stdout
    zeros, total = _expected_zeros()
    assert (zeros, total) == (6, 15)
    lines = [line for line in out.splitlines() if "gradient elements are zero" in line]
    assert len(lines) == 3, out
    assert all(f"naive fp16: {zeros} of {total} gradient elements are zero" in line for line in lines), out


def test_no_zero_count_without_the_option(tmp_path):
    script = tmp_path / "naive.py"
    script.write_text(SCRIPT)
    out = run_python(script, ["off"], timeout=120).stdout
    assert "rank 0 step 2 done" in out
    assert "gradient elements are zero" not in out


def test_two_ranks_rank_0_logs_the_count_of_the_reduced_gradients(tmp_path):
    script = tmp_path / "naive.py"
    script.write_text(SCRIPT)
    out = run_ranks(script, ["on"], nproc=2, timeout=180).stdout
    assert "rank 1 step 2 done" in out and "rank 0 step 2 done" in out
    lines = [line for line in out.splitlines() if "gradient elements are zero" in line]
    assert len(lines) == 3, out  # rank 0 only, once per update
    assert all("naive fp16: 6 of 15 gradient elements are zero" in line for line in lines), out


def test_naive_verbose_logs_each_change_of_the_loss_scale(capsys):
    """``verbose=True`` was accepted and did nothing; legacy's scaler logged each change of the scale. One overflow
    (hysteresis=1) halves it, two good updates (growth_interval=2) double it, and updates between log nothing."""
    from colossal_lite.amp.precision import NaiveAMPPrecision

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    precision = NaiveAMPPrecision(initial_scale=2.0**10, growth_interval=2, hysteresis=1, verbose=True)
    model, opt = precision.setup(model, opt)
    for inputs in (torch.full((2, 4), 1e4), torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 4)):  # 1e4**2: inf
        precision.zero_grad(model, opt)
        precision.backward(model(inputs).pow(2).sum())
        precision.step(opt)
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss scale" in line]  # rank 0's logger
    assert [line.partition("INFO: ")[2] for line in lines] == [
        "naive fp16: loss scale 1024 -> 512 after an overflow (update skipped)",
        "naive fp16: loss scale 512 -> 1024 after 2 updates without overflow"]
    assert precision.loss_scale == 1024


def test_naive_without_verbose_logs_no_loss_scale(capsys):
    from colossal_lite.amp.precision import NaiveAMPPrecision

    model = torch.nn.Linear(4, 2)
    precision = NaiveAMPPrecision(initial_scale=2.0**10, hysteresis=1)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    precision.backward(model(torch.full((2, 4), 1e4)).pow(2).sum())
    precision.step(opt)
    assert precision.loss_scale == 512 and "loss scale" not in capsys.readouterr().out
