"""pytorch/examples' DCGAN update, by hand and through two colossal_lite engines (issue 28, item 2).

The discriminator's update runs two backward calls before one optimizer step (``errD_real.backward();
errD_fake.backward(); optimizerD.step()``), the generator's update runs the discriminator's forward again, and
both networks hold BatchNorm. Used by ``engine/test_dcgan.py`` in the test process (one process) and as a torchrun
script (``dcgan_loop.py OUT``) on 2 ranks, where the hand loop wraps both networks in DDP.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

NZ, NF, STEPS, BATCH = 4, 8, 6, 8


def build():
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(NZ, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, NF), nn.Tanh())
    net_d = nn.Sequential(nn.Linear(NF, 16), nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return net_g, net_d, opt_g, opt_d


def data(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    real = [torch.randn(BATCH, NF, generator=g) * 0.5 + 1.0 for _ in range(STEPS)]
    noise = [torch.randn(BATCH, NZ, generator=g) for _ in range(STEPS)]
    return real, noise


def hand(rank: int, world: int):
    """The original loop (DDP around both networks on several ranks). Returns (net_g, net_d, losses)."""
    net_g, net_d, opt_g, opt_d = build()
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net_g, net_d = DDP(net_g), DDP(net_d)
    criterion = nn.BCELoss()
    real_batches, noises = data(rank)
    losses = []
    for real, noise in zip(real_batches, noises):
        ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
        net_d.zero_grad()
        err_d_real = criterion(net_d(real), ones)
        err_d_real.backward()
        fake = net_g(noise)
        err_d_fake = criterion(net_d(fake.detach()), zeros)
        err_d_fake.backward()
        opt_d.step()
        net_g.zero_grad()
        err_g = criterion(net_d(fake), ones)
        err_g.backward()
        opt_g.step()
        losses.append([(err_d_real + err_d_fake).item(), err_g.item()])
    return _inner(net_g), _inner(net_d), losses


def library(rank: int):
    """The same loop ported to colossal_lite: two engines, the discriminator's with the loader ``initialize``
    returned. Returns (net_g, net_d, losses)."""
    import colossal_lite

    net_g, net_d, opt_g, opt_d = build()
    real_batches, noises = data(rank)
    engine_d, loader, _, _ = colossal_lite.initialize(net_d, opt_d, nn.BCELoss(), train_dataloader=real_batches,
                                                      verbose=False)
    engine_g, *_ = colossal_lite.initialize(net_g, opt_g, nn.BCELoss(), verbose=False)
    losses = []
    for real, noise in zip(loader, noises):
        ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
        engine_d.zero_grad()
        err_d_real = engine_d.criterion(engine_d(real), ones)
        engine_d.backward(err_d_real)
        fake = engine_g(noise)
        err_d_fake = engine_d.criterion(engine_d(fake.detach()), zeros)
        engine_d.backward(err_d_fake)
        assert engine_d.step(), "the discriminator's update was not applied"
        engine_g.zero_grad()
        err_g = engine_g.criterion(engine_d(fake), ones)
        engine_g.backward(err_g)
        assert engine_g.step(), "the generator's update was not applied"
        losses.append([(err_d_real + err_d_fake).item(), err_g.item()])
    return engine_g.unwrapped_model, engine_d.unwrapped_model, losses


def _inner(model):
    return getattr(model, "module", model)


def differences(rank: int, world: int) -> dict:
    """Tensors (parameters and buffers of both networks) that differ, with their largest difference; the losses."""
    hand_g, hand_d, hand_losses = hand(rank, world)
    lib_g, lib_d, lib_losses = library(rank)
    differ = {}
    for tag, a, b in (("G", hand_g, lib_g), ("D", hand_d, lib_d)):
        theirs = dict(list(b.named_parameters()) + list(b.named_buffers()))
        for name, t in list(a.named_parameters()) + list(a.named_buffers()):
            if not torch.equal(t, theirs[name]):
                differ[f"{tag}.{name}"] = float((t.double() - theirs[name].double()).abs().max())
    return dict(differ=differ, hand_losses=hand_losses, lib_losses=lib_losses)


if __name__ == "__main__":
    import json

    import colossal_lite
    from colossal_lite.core import global_context as gpc

    colossal_lite.launch_from_torch(config={}, verbose=False)
    result = differences(gpc.get_global_rank(), gpc.get_world_size())
    with open(f"{sys.argv[1]}.rank{gpc.get_global_rank()}", "w") as f:
        json.dump(result, f)
    gpc.destroy()
