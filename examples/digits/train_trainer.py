"""Train the digits MLP with the Trainer and its hooks (the legacy Colossal-AI trainer flow).

One process:   python examples/digits/train_trainer.py
Two processes: python -m torch.distributed.run --nproc_per_node 2 examples/digits/train_trainer.py
Smoke test:    python examples/digits/train_trainer.py --test-mode   (one step, one eval batch, a verdict)
Keep the curves: python examples/digits/train_trainer.py --log-dir runs/digits
                 colossal-lite plot runs/digits -o curves.png

The hooks log the loss, learning rate and throughput per epoch, the test loss and accuracy
after each evaluation, and memory use; rank 0 prints ``final test accuracy: 0.xxxx``, read from the
history ``fit`` returns. With ``--log-dir`` every recorded value also goes to ``metrics.jsonl`` there.
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
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="write the run's metrics to DIR/metrics.jsonl (draw them with colossal-lite plot DIR)")
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
                         test_interval=5, hooks=hooks, display_progress=True, test_mode=args.test_mode,
                         log_dir=args.log_dir)
    if args.test_mode:  # the verdict is logged; a failed one raised TestModeFailed
        gpc.destroy()
        return 0

    accuracy = result.last("test/Accuracy")  # the last evaluation's, over all ranks (the same on every rank)
    if rank == 0:
        print(f"trained {trainer.cur_step} steps on {world_size} process(es) in {time.perf_counter() - start:.1f} s",
              flush=True)
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
        if args.log_dir is not None:
            print(f"metrics written to {Path(args.log_dir) / 'metrics.jsonl'} "
                  f"(draw them: colossal-lite plot {args.log_dir} -o curves.png)", flush=True)
    gpc.destroy()
    if args.require_accuracy is not None and accuracy < args.require_accuracy:
        if rank == 0:
            print(f"test accuracy {accuracy:.4f} is below the required {args.require_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
