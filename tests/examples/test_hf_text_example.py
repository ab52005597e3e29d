"""The hf_text example on 2 processes (bf16, accumulation, ZeRO stage 2, no criterion) learns the text, and its
sharded checkpoint exports as a Hugging Face folder whose ``from_pretrained`` model gives the trained logits."""
import re

import torch
from dist_helpers import REPO, run_ranks
from optional_packages import require_transformers

require_transformers("the example trains a transformers GPT-2", module_level=True)

SCRIPT = REPO / "examples" / "hf_text" / "train.py"


def one_value(name: str, stdout: str) -> float:
    found = re.findall(rf"^{name}: ([0-9.]+)$", stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one '{name}: X' line (rank 0 only), got {found}\nstdout:\n{stdout}"
    return float(found[0])


def test_hf_text_on_2_processes_learns_and_exports_for_from_pretrained(tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from colossal_lite.checkpoint.cli import main

    run = tmp_path / "run"
    proc = run_ranks(SCRIPT, ["--epochs", "3", "--out", run], nproc=2, timeout=300)
    baseline, final = one_value("unigram baseline", proc.stdout), one_value("final eval loss", proc.stdout)
    assert 2.5 < baseline < 3.5, f"the unigram entropy of English characters is about 3 nats, got {baseline}"
    assert final < baseline, proc.stdout
    assert "trained on 2 process(es)" in proc.stdout
    assert "greedy sample: 'Beautiful is " in proc.stdout
    assert "[Epoch 2 / Test]: Loss = " in proc.stdout + proc.stderr and "Accuracy = " in proc.stdout + proc.stderr
    assert (run / "checkpoints" / "last").exists() and list((run / "checkpoints").glob("*/sharded"))  # ZeRO 2 shards

    out = tmp_path / "hf"
    assert main(["export", str(run / "checkpoints"), str(out), "--hf", str(run)]) == 0
    assert "wrote GPT2LMHeadModel" in capsys.readouterr().out
    probe = torch.load(run / "probe.pt")
    model = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=probe["input_ids"]).logits, probe["logits"])
