"""docs/trainer.md "Your own step": its snippets run as written in fresh processes and print what the page says."""
import re

from dist_helpers import doc_python_blocks, run_python


def test_the_your_own_step_snippets_run_as_the_page_says(tmp_path):
    gan, language_model = doc_python_blocks("docs/trainer.md", "Your own step")
    (tmp_path / "gan.py").write_text(gan)
    (tmp_path / "lm.py").write_text(language_model)
    for run in ("first", "again"):  # the second run resumes from the checkpoint that holds both engines
        result = run_python(tmp_path / "gan.py", timeout=180, cwd=tmp_path)
        assert result.stdout.strip().endswith("generator steps: 12, discriminator updates: 6"), (run, result.stdout)
    assert "nothing to do" in result.stdout + result.stderr
    out = run_python(tmp_path / "lm.py", timeout=180, cwd=tmp_path).stdout
    losses = [float(x) for x in re.search(r"^loss per epoch: ([0-9. ]+)$", out, re.M).group(1).split()]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], out


def test_the_gan_snippet_runs_with_both_engines_in_bf16(tmp_path):
    """The page's GAN with each engine in bf16 (a feature an engine of the step may have): the generator's loss
    judges its bf16 output through the discriminator's module, under the discriminator's autocast (called bare,
    its fp32 weights met a bf16 input and the step failed; found by a probe)."""
    gan = doc_python_blocks("docs/trainer.md", "Your own step")[0]
    bf16 = "fp16=dict(mode=AMP_TYPE.BF16)"
    edited = (gan.replace("import colossal_lite\n", "import colossal_lite\nfrom colossal_lite.amp import AMP_TYPE\n", 1)
              .replace("nn.BCELoss(), verbose=False)", f"nn.BCELoss(), verbose=False, config=dict({bf16}))", 1)
              .replace("config=dict(gradient_accumulation=2)", f"config=dict(gradient_accumulation=2, {bf16})", 1))
    assert edited.count(bf16) == 2, edited
    (tmp_path / "gan_bf16.py").write_text(edited)
    result = run_python(tmp_path / "gan_bf16.py", timeout=180, cwd=tmp_path)
    assert result.stdout.strip().endswith("generator steps: 12, discriminator updates: 6"), result.stdout

