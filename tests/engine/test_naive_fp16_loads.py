"""Naive fp16 keeps fp32 master weights in the optimizer and copies them over the fp16 model at each update, so
weights loaded into the model after ``initialize`` (pretrained ones, a weights-only checkpoint, a checkpoint of a
run under another precision) must reach the masters too. They did not: the next update put the initialisation
back, silently (found by the mixed-precision probe). And a checkpoint of a TORCH-fp16 run resumed under NAIVE
(or back) failed with a bare ``KeyError`` on the other mode's loss-scaler fields."""
import copy

import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.trainer import Trainer, hooks
from colossal_lite.utils import load_checkpoint, save_checkpoint


def naive_engine(launched, lr=0.0, mode=AMP_TYPE.NAIVE, seed=7):
    launched(dict(fp16=dict(mode=mode)))
    model = make_model(seed=seed)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=lr),
                                                    torch.nn.CrossEntropyLoss(), make_batches(2), verbose=False)
    return engine, loader


def one_update(engine, loader):
    for x, y in loader:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        assert engine.step()  # applied (the scale does not overflow on these batches)
        return


def masters(engine):
    return engine.precision.master_params(engine.unwrapped_model, engine.optimizer)


@pytest.mark.parametrize("how", ["load_state_dict", "load_checkpoint", "submodule"])
def test_weights_loaded_after_initialize_survive_the_next_update(launched, tmp_path, how):
    pretrained = make_model(seed=0).state_dict()  # fp32 weights other than the engine's initialisation
    engine, loader = naive_engine(launched)
    model = engine.unwrapped_model
    if how == "load_state_dict":
        model.load_state_dict(pretrained)
    elif how == "load_checkpoint":  # a weights-only file, as for fine-tuning
        torch.save({"model": pretrained, "epoch": 0}, tmp_path / "pre.pt")
        load_checkpoint(tmp_path / "pre.pt", engine.model)
    else:  # into one layer of the model only
        model[2].load_state_dict({k[2:]: v for k, v in pretrained.items() if k.startswith("2.")})
        pretrained = {**{k: v.float() for k, v in model.state_dict().items()}, **{k: v for k, v in pretrained.items()
                                                                                if k.startswith("2.")}}
    one_update(engine, loader)  # lr 0: the update leaves the masters as they are and copies them to the model
    for (name, value), master in zip(model.state_dict().items(), masters(engine)):
        assert torch.equal(master, pretrained[name]), name  # the fp32 values, not their fp16 rounding
        assert torch.equal(value, pretrained[name].half()), name


@pytest.mark.parametrize("saved_mode, resumed_mode", [(AMP_TYPE.TORCH, AMP_TYPE.NAIVE), (AMP_TYPE.NAIVE, AMP_TYPE.TORCH),
                                                       (AMP_TYPE.NAIVE, None)])  # (fp32: it dropped both silently)
def test_a_checkpoint_of_the_other_fp16_mode_resumes_with_its_weights_and_a_fresh_scale(
        launched, tmp_path, saved_mode, resumed_mode):
    engine, loader = naive_engine(launched, lr=0.5, mode=saved_mode, seed=0)
    Trainer(engine).fit(loader, epochs=1, hooks=[hooks.SaveCheckpointHook(1, str(tmp_path / "ck"))], log_dir=False)
    saved = [p.detach().float().clone() for p in masters(engine)]
    engine, loader = naive_engine(launched, mode=resumed_mode)
    now = (rf"uses {resumed_mode.name}: its loss scale starts from fp16\." if resumed_mode else
           r"has no loss scaler \(fp32 or bf16\): it is left \(and the weights are the model's fp16 ones")
    with pytest.warns(UserWarning, match=rf"loss scaler was saved under fp16 mode {saved_mode.name} and this run {now}"):
        Trainer(engine).fit(loader, epochs=1, resume_from=str(tmp_path / "ck" / "last"), log_dir=False)
    assert engine.num_updates == 2
    if saved_mode is AMP_TYPE.NAIVE:  # TORCH trains fp32 weights: the model's fp16 ones are what it can take
        saved = [s.half().float() for s in saved]
    assert all(torch.equal(m, s) for m, s in zip(masters(engine), saved))


def test_the_legacy_file_of_a_naive_run_still_brings_its_masters_back(launched, tmp_path):
    """The file's own fp32 masters win over the fp16 model weights loaded before them."""
    engine, loader = naive_engine(launched, lr=0.5, seed=0)
    one_update(engine, loader)
    save_checkpoint(tmp_path / "ck.pt", 0, engine.model, engine.optimizer)
    saved = [m.clone() for m in masters(engine)]
    engine, loader = naive_engine(launched)
    load_checkpoint(tmp_path / "ck.pt", engine.model, engine.optimizer)
    assert all(torch.equal(m, s) for m, s in zip(masters(engine), saved))
    assert not all(torch.equal(m, m.half().float()) for m in saved)  # the masters hold more than fp16 can


def test_a_deep_copy_of_the_model_neither_shares_nor_copies_the_masters(launched):
    """EMA's average is a deep copy of the model: a load into the copy must leave the training run's masters alone,
    and the copy must not carry a copy of them (an fp32 model's worth of memory for nothing)."""
    engine, _ = naive_engine(launched)
    before = [m.clone() for m in masters(engine)]
    copy_ = copy.deepcopy(engine.unwrapped_model)
    copy_.load_state_dict(make_model(seed=0).state_dict())
    assert all(torch.equal(m, b) for m, b in zip(masters(engine), before))
    # (torch keeps each pre-hook in a wrapper of its own, which the copy copies; the hook inside is what holds them)
    def pre_hooks(model):
        return [getattr(h, "hook", h) for module in model.modules() for h in module._load_state_dict_pre_hooks.values()]

    assert pre_hooks(copy_) and [id(h) for h in pre_hooks(copy_)] == [id(h) for h in pre_hooks(engine.unwrapped_model)]
