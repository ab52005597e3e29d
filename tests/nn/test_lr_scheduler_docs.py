"""docs/lr_scheduler.md stays true: its ```python blocks run in order as one script (as the page says), what
they print matches the output the page shows, and the printed LRs match the schedules worked out by hand."""
import math
import re

import pytest
from dist_helpers import REPO, run_python

PAGE = REPO / "docs" / "lr_scheduler.md"
BASE_LR = 0.1  # the optimizer LR every example on the page starts from


def python_blocks(text: str):
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def page_run(tmp_path_factory):
    """The page's python blocks, joined into one script and run in a fresh process (as a user would)."""
    blocks = python_blocks(PAGE.read_text())
    folder = tmp_path_factory.mktemp("lr_scheduler_docs")
    script = folder / "lr_scheduler_page.py"
    script.write_text("\n".join(blocks))
    proc = run_python(script, timeout=180, cwd=folder)
    return blocks, proc


def printed_line(label: str, output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(label)]
    assert len(lines) == 1, f"expected one line starting {label!r}, got {lines}\noutput:\n{output}"
    return lines[0]


def test_every_python_block_runs_without_scheduler_warnings(page_run):
    blocks, proc = page_run
    # the engine loop, the Trainer by epoch and by update, ReduceLROnPlateau
    assert len(blocks) >= 4, f"the page lost python blocks: found {len(blocks)}"
    # torch warns when a scheduler steps before its optimizer: the page's usage must never do that
    assert "lr_scheduler.step()" not in proc.stderr, proc.stderr


def test_printed_lr_sequence_matches_hand_computation_and_the_page(page_run):
    _, proc = page_run
    line = printed_line("LR of each optimizer update:", proc.stdout)
    values = [float(v) for v in line.split(":", 1)[1].split()]
    assert len(values) == 6, line  # 12 micro-batches with gradient_accumulation=2
    # By hand: CosineAnnealingWarmupLR(total_steps=6, warmup_steps=2) at t = 3 is the cosine's step 1 of 4:
    # 0.1 * (1 + cos(pi / 4)) / 2 = 0.0853553...
    assert values[3] == pytest.approx(0.1 * (1 + math.cos(math.pi / 4)) / 2, abs=5e-7)
    # every update: warm-up (t + 1) / 2 * b, then the cosine over the other 4 updates
    expected = [(t + 1) / 2 * BASE_LR if t < 2 else BASE_LR * (1 + math.cos(math.pi * (t - 2) / 4)) / 2
                for t in range(6)]
    assert values == pytest.approx(expected, abs=5e-7)
    # and the output the page shows is this very line
    shown = re.search(r"It prints:\n\n```\n(.*?)\n```", PAGE.read_text()).group(1)
    assert shown == line


def test_epoch_log_shows_the_lr_each_epoch_trained_at(page_run):
    _, proc = page_run
    output = proc.stdout + proc.stderr
    logged = [float(v) for v in re.findall(r"\[Epoch \d+ / Train\]: .*\| LR = ([0-9.e-]+)", output)]
    # CosineAnnealingLR(total_steps=4) stepped once per epoch: epoch k trained at t = k
    expected = [BASE_LR * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
    assert logged == pytest.approx(expected, rel=1e-4, abs=1e-9), output
    assert printed_line("LR after the last epoch:", proc.stdout) == "LR after the last epoch: 0.0"


def test_per_update_schedule_takes_one_step_per_update(page_run):
    _, proc = page_run
    # 4 epochs of ceil(4 batches / gradient_accumulation 2) updates: total_steps = 8 is used up exactly
    assert printed_line("updates per epoch:", proc.stdout) == "updates per epoch: 2 | schedule steps taken: 8"


def test_multistep_time_milestones_block_prints_what_the_page_says(page_run):
    _, proc = page_run
    for label in ("milestones resolved to:", "epoch milestones resolved to:"):
        line = printed_line(label, proc.stdout)
        assert f"`{line}`" in PAGE.read_text(), line
    assert printed_line("milestones resolved to:", proc.stdout) == "milestones resolved to: [6, 12, 18]"
    assert printed_line("epoch milestones resolved to:", proc.stdout) == "epoch milestones resolved to: [4, 12]"


def test_nanogpt_schedule_snippet_gives_nanogpts_lr_at_every_update(page_run):
    """The page's LambdaLR recipe uses, at update t, the LR nanoGPT's get_lr(t) gives: warm-up (t+1)/(w+1), cosine,
    then the floor held past lr_decay_iters (where CosineAnnealingWarmupLR's cosine would climb back)."""
    _, proc = page_run
    line = printed_line("nanoGPT LR of each update:", proc.stdout)
    got = [float(v) for v in line.split(":")[1].split()]
    base, floor, warmup, decay = 0.1, 0.01, 2, 6
    expected = [base * (t + 1) / (warmup + 1) if t < warmup else floor if t > decay else
                floor + 0.5 * (1 + math.cos(math.pi * (t - warmup) / (decay - warmup))) * (base - floor)
                for t in range(9)]
    assert got == pytest.approx(expected, abs=5e-7)
    assert got[-3:] == [floor] * 3
    page = PAGE.read_text()
    assert "nanoGPT LR of each update: " + " ".join(f"{v:.6f}" for v in expected[:7]) in page.replace("\n", " ")
