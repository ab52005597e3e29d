"""Train the digits MLP with the Trainer and its hooks (the legacy Colossal-AI trainer flow).

One process:   python examples/digits/train_trainer.py
Two processes: python -m torch.distributed.run --nproc_per_node 2 examples/digits/train_trainer.py
Smoke test:    python examples/digits/train_trainer.py --test-mode   (one step, one eval batch, a verdict)

The hooks log the loss, learning rate and throughput per epoch, the test loss and accuracy
after each evaluation, and memory use; rank 0 prints ``final test accuracy: 0.xxxx``.
"""
from __future__ import annotations

import argparse
import sys
import time
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
from colossal_lite.trainer.hooks import (
    AccuracyHook,
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LossHook,
    LRSchedulerHook,
    ThroughputHook,
)
from colossal_lite.utils import get_current_device, get_dataloader

CONFIG = Path(__file__).resolve().with_name("config.py")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="config file (default: config.py next to this script)")
    parser.add_argument("--require-accuracy", type=float, default=None, metavar="FRACTION",
                        help="exit with status 1 if the final test accuracy is below this, e.g. 0.95")
    parser.add_argument("--test-mode", action="store_true", help="run one step and one eval batch, print a verdict")
    return parser.parse_args()


def shard(dataset, rank: int, world_size: int):
    """Every ``world_size``-th test sample from ``rank`` on: the shards cover the test set exactly once."""
    return Subset(dataset, range(rank, len(dataset), world_size)) if world_size > 1 else dataset


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    colossal_lite.launch_from_torch(config=args.config, seed=1024)
    logger = get_dist_logger()
    cfg = gpc.config
    if get_current_device().type == "cpu":
        torch.set_num_threads(1)  # tiny layers: extra OpenMP threads only cost time
    rank, world_size = gpc.get_global_rank(), gpc.get_world_size()

    train_dataset, test_dataset = build_datasets(seed=0)
    train_loader = get_dataloader(train_dataset, shuffle=True, seed=1024, batch_size=cfg.BATCH_SIZE)
    # each rank scores its own shard; the metric hooks sum the counts over the ranks
    test_loader = get_dataloader(shard(test_dataset, rank, world_size), add_sampler=False, batch_size=256)

    model = build_model(hidden=cfg.HIDDEN)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LR, momentum=cfg.MOMENTUM, weight_decay=cfg.WEIGHT_DECAY)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=cfg.NUM_EPOCHS)  # stepped once per epoch
    engine, train_loader, test_loader, lr_scheduler = colossal_lite.initialize(
        model, optimizer, torch.nn.CrossEntropyLoss(), train_loader, test_loader, lr_scheduler)

    trainer = Trainer(engine=engine, logger=logger)
    hooks = [
        LossHook(),
        LRSchedulerHook(lr_scheduler, by_epoch=True),
        AccuracyHook(accuracy_func=Accuracy()),
        LogMetricByStepHook(),  # loss / lr / throughput on the progress display
        LogMetricByEpochHook(logger, interval=5),
        LogMemoryByEpochHook(logger, interval="10ep"),
        ThroughputHook(ignored_steps=2),
    ]
    result = trainer.fit(train_dataloader=train_loader, epochs=cfg.NUM_EPOCHS, test_dataloader=test_loader,
                         test_interval=5, hooks=hooks, display_progress=True, test_mode=args.test_mode)
    if args.test_mode:
        gpc.destroy()
        return 0 if result.ok else 1

    # the last evaluation's accuracy, all ranks together (already reduced by the log hook: read from its cache)
    accuracy = trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value()
    if rank == 0:
        print(f"trained {trainer.cur_step} steps on {world_size} process(es) in {time.perf_counter() - start:.1f} s",
              flush=True)
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    gpc.destroy()
    if args.require_accuracy is not None and accuracy < args.require_accuracy:
        if rank == 0:
            print(f"test accuracy {accuracy:.4f} is below the required {args.require_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
