"""Train the digits MLP with MixUp and a hook of our own that reports the gradient norm.

One process:   python examples/digits/train_mixup_custom_hook.py
Two processes: python -m torch.distributed.run --nproc_per_node 2 examples/digits/train_mixup_custom_hook.py

``GradNormReport`` shows the two sides of a hook: it listens to the ``after_grad_norm`` event
(the global L2 norm of the gradients, measured before each optimizer step), keeps the values on
the device, and reads them once every ``every_n_steps`` steps, so training never waits for it.
``MixUp`` changes training through the events: it mixes each batch's inputs after loading and
mixes the targets to match.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import build_datasets, build_model
from torch.utils.data import Subset

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
from colossal_lite.nn.lr_scheduler import CosineAnnealingLR
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import AccuracyHook, BaseHook, LogMetricByEpochHook, LossHook, LRSchedulerHook, MixUp
from colossal_lite.utils import get_current_device, get_dataloader

CONFIG = Path(__file__).resolve().with_name("config.py")


class GradNormReport(BaseHook):
    """Logs the mean and max gradient norm of the last ``every_n_steps`` optimizer steps (rank 0)."""

    def __init__(self, logger, every_n_steps: int = 100):
        super().__init__(priority=20)
        self.logger = logger
        self.every_n_steps = every_n_steps
        self.norms = []

    def after_grad_norm(self, trainer, grad_norm):
        self.norms.append(grad_norm)  # a device tensor: no sync here
        step = trainer.cur_step + 1  # cur_step counts the steps before this one
        if step % self.every_n_steps == 0:
            norms = torch.stack(self.norms)
            mean, top = torch.stack([norms.mean(), norms.max()]).tolist()  # one read for the whole window
            self.logger.info(f"step {step}: gradient norm mean {mean:.3f}, max {top:.3f} "
                             f"(last {len(self.norms)} steps, before clipping)", ranks=[0])
            self.norms.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="config file (default: config.py next to this script)")
    parser.add_argument("--alpha", type=float, default=0.2, help="MixUp's Beta(alpha, alpha) parameter")
    parser.add_argument("--epochs", type=int, default=None, help="override NUM_EPOCHS of the config")
    args = parser.parse_args()

    colossal_lite.launch_from_torch(config=args.config, seed=1024)
    logger = get_dist_logger()
    cfg = gpc.config
    epochs = args.epochs or cfg.NUM_EPOCHS
    if get_current_device().type == "cpu":
        torch.set_num_threads(1)
    rank, world_size = gpc.get_global_rank(), gpc.get_world_size()

    train_dataset, test_dataset = build_datasets(seed=0)
    train_loader = get_dataloader(train_dataset, shuffle=True, seed=1024, batch_size=cfg.BATCH_SIZE)
    test_shard = Subset(test_dataset, range(rank, len(test_dataset), world_size))
    test_loader = get_dataloader(test_shard, add_sampler=False, batch_size=256)

    model = build_model(hidden=cfg.HIDDEN)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LR, momentum=cfg.MOMENTUM, weight_decay=cfg.WEIGHT_DECAY)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=epochs)
    # CrossEntropyLoss accepts the mixed (soft) targets MixUp gives it
    engine, train_loader, test_loader, lr_scheduler = colossal_lite.initialize(
        model, optimizer, torch.nn.CrossEntropyLoss(), train_loader, test_loader, lr_scheduler)

    hooks = [
        MixUp(alpha=args.alpha),
        GradNormReport(logger, every_n_steps=200),
        LossHook(),
        AccuracyHook(Accuracy()),
        LRSchedulerHook(lr_scheduler, by_epoch=True),
        LogMetricByEpochHook(logger, interval="5ep"),
    ]
    trainer = Trainer(engine, logger=logger)
    trainer.fit(train_loader, epochs=epochs, test_dataloader=test_loader, test_interval="5ep", hooks=hooks)
    accuracy = trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value()
    if rank == 0:
        print(f"final test accuracy with MixUp(alpha={args.alpha}): {accuracy:.4f}", flush=True)
    gpc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
