"""``colossal-lite ckpt export CKPT OUT --hf CONFIG``: a checkpoint's weights as a Hugging Face folder, and
``from_pretrained`` of that folder gives the trained model's logits exactly. One process here (an unsharded
checkpoint, EMA weights too); tests/examples/test_hf_text_example.py exports a 2-rank ZeRO (sharded) one."""
import json

import pytest
import torch
from optional_packages import require_transformers

require_transformers("exporting a Hugging Face folder builds a transformers model", module_level=True)

import colossal_lite  # noqa: E402
from colossal_lite.checkpoint.cli import main  # noqa: E402
from colossal_lite.checkpoint.hf_export import export_hf  # noqa: E402
from colossal_lite.trainer import Trainer, hooks  # noqa: E402

pytestmark = pytest.mark.slow  # builds and saves transformers models (seconds each)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=30, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT-2 trained 2 epochs by the Trainer with no criterion and an EMAHook, checkpointed each epoch; its
    config saved beside (the model's own config.json, no 'architectures' in it)."""
    from colossal_lite.core import global_context as gpc

    folder = tmp_path_factory.mktemp("run")
    gpc.destroy()
    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), verbose=False)
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    batches = [dict(input_ids=ids, labels=ids) for ids in torch.randint(0, 30, (6, 2, 8), generator=g)]
    engine, loader, _, _ = colossal_lite.initialize(model, lambda p: torch.optim.AdamW(p, lr=0.01),
                                                    train_dataloader=batches, verbose=False)
    ema = hooks.EMAHook(decay=0.5)
    Trainer(engine).fit(loader, epochs=2, display_progress=False,
                        hooks=[ema, hooks.SaveCheckpointHook(checkpoint_dir=str(folder / "ck"))])
    model.config.save_pretrained(folder / "config")
    probe = torch.randint(0, 30, (3, 8), generator=g)
    with torch.no_grad():
        live = model.eval()(input_ids=probe).logits
        average = ema.ema_model.module.eval()(input_ids=probe).logits
    gpc.destroy()
    return dict(folder=folder, probe=probe, live=live, average=average)


def logits_of(folder, probe):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=probe).logits


def test_export_then_from_pretrained_gives_the_trained_logits(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(trained["folder"] / "ck"), str(out), "--hf", str(trained["folder"] / "config"),
                 "--hf-class", "GPT2LMHeadModel"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote GPT2LMHeadModel with 29 tensors to {out} (model.safetensors, config.json)" in printed, printed
    assert "GPT2LMHeadModel.from_pretrained" in printed
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert torch.equal(logits_of(out, trained["probe"]), trained["live"])
    # the exported folder's config names its class, so a second export needs no --hf-class
    again = export_hf(trained["folder"] / "ck", tmp_path / "again", out)
    assert again.model_class == "GPT2LMHeadModel" and again.source == "model"
    assert torch.equal(logits_of(tmp_path / "again", trained["probe"]), trained["live"])


def test_export_of_the_ema_average(trained, tmp_path):
    out = export_hf(trained["folder"] / "ck", tmp_path / "ema", trained["folder"] / "config", "GPT2LMHeadModel",
                    ema=True)
    assert out.source == "EMAHook.0"
    logits = logits_of(tmp_path / "ema", trained["probe"])
    assert torch.equal(logits, trained["average"]) and not torch.equal(logits, trained["live"])


def test_export_errors_name_the_fix(trained, tmp_path, capsys):
    from transformers import GPT2Config

    ck, config = str(trained["folder"] / "ck"), str(trained["folder"] / "config")
    wider = tmp_path / "wider"
    GPT2Config(vocab_size=30, n_positions=8, n_embd=32, n_layer=2, n_head=2).save_pretrained(wider)
    cases = [
        (["--hf", str(tmp_path / "nowhere")], "no Hugging Face config at"),
        (["--hf", config], "names no model class (its 'architectures' is empty): name it, e.g. --hf-class"),
        (["--hf", config, "--hf-class", "NoSuchModel"], "transformers has no model class 'NoSuchModel'"),
        (["--hf", config, "--hf-class", "GPT2Model"], "the checkpoint's weights do not fit GPT2Model built from this "
                                                      "config: missing"),
        (["--hf-class", "GPT2LMHeadModel"], "--hf-class names the model class of a Hugging Face export: give --hf"),
        # (these two were tracebacks, found by a probe of the command line)
        (["--hf", str(wider), "--hf-class", "GPT2LMHeadModel"], "the checkpoint's weights do not fit GPT2LMHeadModel "
                                                                 "built from this config: size mismatch"),
        (["--hf", config, "--hf-class", "BertModel"], "BertModel cannot be built from this config (GPT2Config)"),
    ]
    for extra, message in cases:
        assert main(["export", ck, str(tmp_path / "out"), *extra]) == 1, extra
        err = capsys.readouterr().err
        assert message in err, (extra, err)
    assert not (tmp_path / "out").exists()  # nothing written by a failed export
    # onto a file: transformers wrote nothing and said so in a log line, and the command said it wrote the folder
    # and exited 0 (found by the same probe)
    (tmp_path / "file").write_bytes(b"kept")
    assert main(["export", ck, str(tmp_path / "file"), "--hf", config, "--hf-class", "GPT2LMHeadModel"]) == 1
    assert "is a file, and a Hugging Face export is a folder: nothing was written" in capsys.readouterr().err
    assert (tmp_path / "file").read_bytes() == b"kept"
