"""pytorch/examples' DCGAN update under ``Trainer.fit`` with a step of the user's own, against the hand loop.

Two engines (generator and discriminator), two optimizers, BatchNorm in both, two backward calls before the
discriminator's step. ``d_accumulation > 1`` gives the discriminator alone gradient accumulation
(``initialize(..., config=dict(gradient_accumulation=N))``); the hand loop is then what a careful user writes:
each loss divided by its window's size (the epoch's last window may be shorter), DDP's ``no_sync`` on the
window's other micro-batches, and the discriminator frozen for the generator's update (pix2pix's
``set_requires_grad(netD, False)``), run as its module past DDP (frozen parameters never report to DDP), so that
the generator's backward adds nothing to the gradients it is accumulating.

Used in the test process (one process) and as a torchrun script (``user_step_programs.py OUT CKPT_DIR``) that
runs every comparison, the word-language-model one included, in one 2-rank launch; there the discriminator also
runs under ZeRO stage 2 (its own feature) in a run that must resume exactly.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import word_language_model_loop
from dcgan_loop import BATCH, NF, NZ
from dcgan_loop import build as build_gan
from torch import nn

from colossal_lite.trainer.hooks import BaseHook

BATCHES, EPOCHS = 7, 2


def data(rank: int):
    """(real, noise) batches of this rank: the epoch's last discriminator window is short with accumulation 2."""
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(BATCH, NF, generator=g) * 0.5 + 1.0, torch.randn(BATCH, NZ, generator=g))
            for _ in range(BATCHES)]


def _place(i: int, accumulation: int):
    """(divisor, first, last) of batch ``i`` in its discriminator window, as the Trainer plans an epoch."""
    start = i - i % accumulation
    divisor = min(accumulation, BATCHES - start)
    return divisor, i == start, i == start + divisor - 1


def hand(rank: int, world: int, d_accumulation: int = 1):
    """The original loop for EPOCHS epochs (DDP around both networks on several ranks); -> (net_g, net_d, losses)."""
    net_g, net_d, opt_g, opt_d = build_gan()
    inner_d = net_d
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net_g, net_d = DDP(net_g), DDP(net_d)
    criterion, losses = nn.BCELoss(), []
    for _ in range(EPOCHS):
        for i, (real, noise) in enumerate(data(rank)):
            ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
            divisor, first, last = _place(i, d_accumulation)
            if first:
                net_d.zero_grad()
            sync = contextlib.nullcontext() if last or world == 1 else net_d.no_sync()
            with sync:
                err_d_real = criterion(net_d(real), ones)
                (err_d_real / divisor if divisor > 1 else err_d_real).backward()
                fake = net_g(noise)
                err_d_fake = criterion(net_d(fake.detach()), zeros)
                (err_d_fake / divisor if divisor > 1 else err_d_fake).backward()
            if last:
                opt_d.step()
            net_g.zero_grad()
            err_g = _generator_loss(criterion, net_d, inner_d, fake, ones, d_accumulation)
            err_g.backward()
            inner_d.requires_grad_(True)
            opt_g.step()
            losses.append([(err_d_real + err_d_fake).item(), err_g.item()])
    return _inner(net_g), inner_d, losses


def _generator_loss(criterion, net_d, inner_d, fake, ones, d_accumulation):
    if d_accumulation == 1:  # the original: the discriminator's gradients are cleared before its next update
        return criterion(net_d(fake), ones)
    inner_d.requires_grad_(False)
    return criterion(inner_d(fake), ones)


def _inner(model):
    return getattr(model, "module", model)


def gan_step(engine_g, engine_d, d_accumulation: int):
    """The hand loop's body with the engines, as ``UserStep(train, engines={...})`` runs it."""
    criterion = engine_d.criterion

    def train(trainer, batch):
        real, noise = batch
        ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
        engine_d.zero_grad()
        err_d_real = criterion(engine_d(real), ones)
        engine_d.backward(err_d_real)
        fake = engine_g(noise)
        err_d_fake = criterion(engine_d(fake.detach()), zeros)
        engine_d.backward(err_d_fake)
        engine_d.step()
        engine_g.zero_grad()
        if d_accumulation == 1:
            err_g = criterion(engine_d(fake), ones)
        else:
            net_d = engine_d.unwrapped_model
            net_d.requires_grad_(False)
            err_g = criterion(net_d(fake), ones)
        engine_g.backward(err_g)
        engine_d.unwrapped_model.requires_grad_(True)
        engine_g.step()
        return {"Loss_D": err_d_real + err_d_fake, "Loss_G": err_g}, None, err_g

    return train


def library(rank: int, d_accumulation: int = 1, max_steps=None, checkpoint_dir=None, resume: bool = False,
            d_zero=None):
    """The same program under ``Trainer.fit`` (``d_zero``: the discriminator's ZeRO stage, None: none); -> (net_g,
    net_d, losses of the iterations this fit ran)."""
    import colossal_lite
    from colossal_lite.trainer import Trainer, UserStep
    from colossal_lite.trainer.hooks import SaveCheckpointHook

    net_g, net_d, opt_g, opt_d = build_gan()
    engine_g, *_ = colossal_lite.initialize(net_g, opt_g, nn.BCELoss(), verbose=False)
    engine_d, *_ = colossal_lite.initialize(net_d, opt_d, nn.BCELoss(), verbose=False,
                                            config=dict(gradient_accumulation=d_accumulation,
                                                        zero=dict(stage=d_zero) if d_zero else None))
    recorder = GanLosses()
    hooks = [recorder] + ([SaveCheckpointHook("3ba", checkpoint_dir=checkpoint_dir)] if checkpoint_dir else [])
    step = UserStep(gan_step(engine_g, engine_d, d_accumulation),
                    engines={"generator": engine_g, "discriminator": engine_d})
    Trainer(engine_g).fit(data(rank), epochs=EPOCHS, max_steps=max_steps, step=step, hooks=hooks, log_dir=False,
                          resume_from="last" if resume else None)
    return engine_g.unwrapped_model, engine_d.unwrapped_model, recorder.losses


class GanLosses(BaseHook):
    """Loss_D and Loss_G of every iteration on this rank, read to floats (a test reads them all)."""

    def __init__(self):
        super().__init__(priority=100)
        self.losses = []

    def after_train_iter(self, trainer, output, label, loss):
        self.losses.append([float(output["Loss_D"].detach()), float(output["Loss_G"].detach())])


def differing(nets_a, nets_b, buffers_of: str = "GD") -> dict:
    """Parameters and buffers (of the networks ``buffers_of`` names) of (generator, discriminator) that differ, with
    their largest difference."""
    differ = {}
    for tag, a, b in zip("GD", nets_a, nets_b):
        theirs = dict(list(b.named_parameters()) + list(b.named_buffers()))
        for name, t in list(a.named_parameters()) + (list(a.named_buffers()) if tag in buffers_of else []):
            if not torch.equal(t, theirs[name]):
                differ[f"{tag}.{name}"] = float((t.double() - theirs[name].double()).abs().max())
    return differ


def compare(rank: int, world: int, d_accumulation: int) -> dict:
    hand_g, hand_d, hand_losses = hand(rank, world, d_accumulation)
    lib_g, lib_d, lib_losses = library(rank, d_accumulation)
    return dict(differ=differing((hand_g, hand_d), (lib_g, lib_d)), hand_losses=hand_losses, lib_losses=lib_losses)


def resume(rank: int, d_accumulation: int, checkpoint_dir, d_zero=None) -> dict:
    """An uninterrupted run against one stopped after 3 steps (the discriminator inside its window with
    accumulation) and resumed from its checkpoint by a fresh program."""
    full_g, full_d, full_losses = library(rank, d_accumulation, d_zero=d_zero)
    library(rank, d_accumulation, max_steps=3, checkpoint_dir=checkpoint_dir, d_zero=d_zero)
    res_g, res_d, res_losses = library(rank, d_accumulation, checkpoint_dir=checkpoint_dir, resume=True, d_zero=d_zero)
    # Under ZeRO stage 2 nothing syncs buffers, so each rank's BatchNorm running statistics differ, and a checkpoint
    # keeps one rank's copy (for the Trainer's own engine too): the discriminator's buffers are not compared there.
    differ = differing((full_g, full_d), (res_g, res_d), buffers_of="GD" if d_zero is None else "G")
    return dict(differ=differ, full_losses=full_losses[3:],
                resumed_losses=res_losses)


if __name__ == "__main__":
    import json

    import colossal_lite
    from colossal_lite.core import global_context as gpc

    colossal_lite.launch_from_torch(config={}, verbose=False)
    rank, world = gpc.get_global_rank(), gpc.get_world_size()
    result = dict(gan=compare(rank, world, 1), gan_d_accumulation=compare(rank, world, 2),
                  resume=resume(rank, 2, sys.argv[2]), resume_d_zero2=resume(rank, 1, sys.argv[2] + "-zero2", d_zero=2),
                  lm=word_language_model_loop.differences(rank, world))
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump(result, f)
    gpc.destroy()
