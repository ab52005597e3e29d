"""Train a small MLP on scikit-learn's handwritten digits with the colossal_lite engine loop.

One process:   python examples/digits/train_engine.py
Two processes: python -m torch.distributed.run --nproc_per_node 2 examples/digits/train_engine.py

Every process trains on its own shard of the training set; the test accuracy is summed
over all ranks and printed by rank 0 as ``final test accuracy: 0.xxxx``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import build_datasets, build_model
from torch.utils.data import Subset

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
from colossal_lite.nn.lr_scheduler import CosineAnnealingLR
from colossal_lite.nn.metric import Accuracy
from colossal_lite.utils import get_current_device, get_dataloader

CONFIG = Path(__file__).resolve().with_name("config.py")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="config file (default: config.py next to this script)")
    parser.add_argument("--require-accuracy", type=float, default=None, metavar="FRACTION",
                        help="exit with status 1 if the final test accuracy is below this, e.g. 0.95")
    return parser.parse_args()


def shard(dataset, rank: int, world_size: int):
    """Every ``world_size``-th sample starting at ``rank``: the shards cover the set exactly once (no padding)."""
    return Subset(dataset, range(rank, len(dataset), world_size)) if world_size > 1 else dataset


@torch.no_grad()
def evaluate(engine, test_loader, device) -> float:
    """Top-1 accuracy over the whole test set: each rank counts its shard, then the counts are summed.

    Every rank must call this (the all-reduce is a collective).
    """
    engine.eval()
    accuracy = Accuracy()
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct, seen
    for data, label in test_loader:
        data, label = data.to(device), label.to(device)
        output = engine(data)
        counts[0] += accuracy(output, label)
        counts[1] += label.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    correct, seen = counts.tolist()
    return correct / max(seen, 1)


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    colossal_lite.launch_from_torch(config=args.config, seed=1024)
    logger = get_dist_logger()
    cfg = gpc.config
    device = get_current_device()
    if device.type == "cpu":
        # the layers are tiny: extra OpenMP threads cost more than they give (and spin on a busy machine)
        torch.set_num_threads(1)
    rank, world_size = gpc.get_global_rank(), gpc.get_world_size()

    train_dataset, test_dataset = build_datasets(seed=0)
    train_loader = get_dataloader(train_dataset, shuffle=True, seed=1024, batch_size=cfg.BATCH_SIZE)
    test_loader = get_dataloader(shard(test_dataset, rank, world_size), add_sampler=False, batch_size=256)

    model = build_model(hidden=cfg.HIDDEN)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LR, momentum=cfg.MOMENTUM, weight_decay=cfg.WEIGHT_DECAY)
    criterion = torch.nn.CrossEntropyLoss()
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=cfg.NUM_EPOCHS)  # stepped once per epoch
    engine, train_loader, test_loader, lr_scheduler = colossal_lite.initialize(
        model, optimizer, criterion, train_loader, test_loader, lr_scheduler)

    for epoch in range(cfg.NUM_EPOCHS):
        engine.train()
        loss_sum = torch.zeros((), device=device)  # stays on the device: read once per epoch
        for data, label in train_loader:
            data, label = data.to(device), label.to(device)
            engine.zero_grad()
            output = engine(data)
            loss = engine.criterion(output, label)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach()
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        if epoch % 10 == 9 or epoch == cfg.NUM_EPOCHS - 1:
            accuracy = evaluate(engine, test_loader, device)  # on every rank: it holds a collective
            logger.info(f"epoch {epoch + 1}/{cfg.NUM_EPOCHS} - train loss (rank 0): "
                        f"{loss_sum.item() / len(train_loader):.4f}, test accuracy: {accuracy:.4f}, lr: {lr:.4g}",
                        ranks=[0])

    accuracy = evaluate(engine, test_loader, device)
    if rank == 0:
        print(f"trained on {world_size} process(es) in {time.perf_counter() - start:.1f} s", flush=True)
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    gpc.destroy()
    if args.require_accuracy is not None and accuracy < args.require_accuracy:
        if rank == 0:
            print(f"test accuracy {accuracy:.4f} is below the required {args.require_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
