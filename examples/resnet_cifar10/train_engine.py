"""Train ResNet-18 on CIFAR-10 with the colossal_lite engine loop (the engine tutorial's flow).

    python -m torch.distributed.run --nproc_per_node N examples/resnet_cifar10/train_engine.py
    python examples/resnet_cifar10/train_engine.py --synthetic --max-steps 20   # no download, random images

CIFAR-10 is downloaded to ``--data-root`` (default ``$DATA`` or ``./data``) when it is not
there yet. ``--synthetic`` uses random tensors of CIFAR-10's shape instead, for machines
without network; it checks that the loop runs, not that the model learns.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset, TensorDataset

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
from colossal_lite.nn.lr_scheduler import CosineAnnealingLR
from colossal_lite.nn.metric import Accuracy
from colossal_lite.utils import get_current_device, get_dataloader

HERE = Path(__file__).resolve().parent
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)  # CIFAR-10 per-channel statistics
NUM_CLASSES = 10


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None,
                        help="config file (default: config.py next to this script with CUDA, config_cpu.py without)")
    parser.add_argument("--data-root", default=os.environ.get("DATA", "./data"),
                        help="where CIFAR-10 is (or is downloaded to); default $DATA or ./data")
    parser.add_argument("--synthetic", action="store_true", help="random tensors of CIFAR-10's shape, no download")
    parser.add_argument("--synthetic-batches", type=int, default=4, help="training batches per process with --synthetic")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many training steps in all (and test on at most this many batches)")
    parser.add_argument("--epochs", type=int, default=None, help="override the config's NUM_EPOCHS")
    parser.add_argument("--batch-size", type=int, default=None, help="override the config's BATCH_SIZE")
    parser.add_argument("--num-workers", type=int, default=2, help="dataloader worker processes (real data only)")
    return parser.parse_args()


def build_resnet18() -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 stem and no max-pool, the usual shape for 32x32 images."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=NUM_CLASSES)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_cifar10(root: str):
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    normalize = transforms.Normalize(mean=MEAN, std=STD)
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    # rank 0 downloads first; the others wait at the barrier, then find the files
    if gpc.get_global_rank() == 0:
        train = _download(lambda: CIFAR10(root=root, train=True, download=True, transform=train_tf), root)
    if dist.is_initialized():
        dist.barrier()
    if gpc.get_global_rank() != 0:
        train = CIFAR10(root=root, train=True, download=False, transform=train_tf)
    test = CIFAR10(root=root, train=False, download=False, transform=test_tf)
    return train, test


def _download(make, root: str):
    try:
        return make()
    except (OSError, RuntimeError) as e:  # no network, or a broken archive
        raise SystemExit(f"could not load or download CIFAR-10 into {root!r} ({type(e).__name__}: {e}). "
                         f"Put the data set there (or set --data-root / $DATA), or run with --synthetic") from e


def build_synthetic(batch_size: int, train_batches: int, world_size: int):
    """Random normalised images and labels: ``train_batches`` batches per process, one test batch per process."""
    g = torch.Generator().manual_seed(0)

    def make(n):
        return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g))

    return make(batch_size * train_batches * world_size), make(batch_size * world_size)


def shard(dataset, rank: int, world_size: int):
    """Every ``world_size``-th sample starting at ``rank``: the shards cover the set exactly once (no padding)."""
    return Subset(dataset, range(rank, len(dataset), world_size)) if world_size > 1 else dataset


@torch.no_grad()
def evaluate(engine, test_loader, device, max_batches=None):
    """``(accuracy, mean test loss)`` over all ranks' shards; every rank must call it (all-reduce)."""
    engine.eval()
    accuracy = Accuracy()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, seen, summed loss
    for i, (img, label) in enumerate(test_loader):
        if max_batches is not None and i >= max_batches:
            break
        img, label = img.to(device, non_blocking=True), label.to(device, non_blocking=True)
        output = engine(img)
        loss = engine.criterion(output, label)
        sums += torch.stack([accuracy(output, label).double(), torch.tensor(label.numel(), dtype=torch.float64,
                             device=device), loss.detach().double() * label.numel()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    correct, seen, loss_sum = sums.tolist()
    return correct / max(seen, 1), loss_sum / max(seen, 1)


def main() -> int:
    args = parse_args()
    config = args.config or HERE / ("config.py" if torch.cuda.is_available() else "config_cpu.py")
    colossal_lite.launch_from_torch(config=config)
    logger = get_dist_logger()
    cfg = gpc.config
    device = get_current_device()
    logger.info(f"config: {config}", ranks=[0])
    rank, world_size = gpc.get_global_rank(), gpc.get_world_size()
    batch_size = args.batch_size or cfg.BATCH_SIZE
    num_epochs = args.epochs or cfg.NUM_EPOCHS

    model = build_resnet18()
    if args.synthetic:
        train_dataset, test_dataset = build_synthetic(batch_size, args.synthetic_batches, world_size)
        num_workers = 0
    else:
        train_dataset, test_dataset = build_cifar10(args.data_root)
        num_workers = args.num_workers
    pin = device.type == "cuda"
    train_loader = get_dataloader(train_dataset, shuffle=True, batch_size=batch_size, num_workers=num_workers,
                                  pin_memory=pin, persistent_workers=num_workers > 0)
    test_loader = get_dataloader(shard(test_dataset, rank, world_size), add_sampler=False, batch_size=batch_size,
                                 num_workers=num_workers, pin_memory=pin)

    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LR, momentum=cfg.MOMENTUM, weight_decay=cfg.WEIGHT_DECAY)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=num_epochs)
    engine, train_loader, test_loader, lr_scheduler = colossal_lite.initialize(
        model, optimizer, criterion, train_loader, test_loader, lr_scheduler)

    steps = 0
    for epoch in range(num_epochs):
        engine.train()
        for img, label in train_loader:
            img, label = img.to(device, non_blocking=True), label.to(device, non_blocking=True)
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
            steps += 1
            if args.max_steps is not None and steps >= args.max_steps:
                break
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()

        acc, test_loss = evaluate(engine, test_loader, device, max_batches=args.max_steps)
        logger.info(f"Epoch {epoch} - train loss: {train_loss.item():.5}, test loss: {test_loss:.5}, "
                    f"acc: {acc:.5}, lr: {lr:.5g}", ranks=[0])
        if args.max_steps is not None and steps >= args.max_steps:
            break

    if rank == 0:
        print(f"trained {steps} steps per process on {world_size} process(es); final test accuracy: {acc:.4f}",
              flush=True)
    gpc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
