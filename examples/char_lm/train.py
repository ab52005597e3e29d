"""Train a tiny character-level language model on data.txt with per-token gradient reduction.

One process:   python examples/char_lm/train.py
Two processes: python -m torch.distributed.run --nproc_per_node 2 examples/char_lm/train.py

Each line of data.txt is one padded sample; the criterion returns (loss sum, real-token count)
and the engine (grad_reduction='per-token-mean') makes every update the mean over all real
characters of the global batch. Rank 0 prints ``unigram baseline: Y`` (the entropy of the
character frequencies, in nats) and at the end ``final per-token loss: X`` (an evaluation pass
over the whole text, summed over all ranks) and a greedy sample.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from model import (
    IGNORE_INDEX,
    CharGRU,
    Vocabulary,
    build_samples,
    greedy_sample,
    pad_collate,
    read_lines,
    token_loss,
    unigram_entropy,
)

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
from colossal_lite.nn.lr_scheduler import CosineAnnealingLR
from colossal_lite.utils import get_current_device, get_dataloader

CONFIG = Path(__file__).resolve().with_name("config.py")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="config file (default: config.py next to this script)")
    parser.add_argument("--epochs", type=int, default=None, help="passes over the text (default: NUM_EPOCHS of the config)")
    parser.add_argument("--require-loss-below", type=float, default=None, metavar="NATS",
                        help="exit with status 1 unless the final per-token loss is below this, e.g. 2.0")
    return parser.parse_args()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (every rank must call it); the tensor itself with one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def evaluate(model, samples, rank: int, world_size: int, device) -> float:
    """Per-token loss (nats) over every line of the text: each rank scores every ``world_size``-th line,
    then the loss sums and token counts are summed over all ranks, so every rank returns the same value.

    Runs the unwrapped model (no DDP), so ranks with different numbers of batches cannot
    desynchronise; the one collective is the all-reduce at the end, called by every rank.
    """
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, real tokens
    shard = samples[rank::world_size]
    for start in range(0, len(shard), 32):
        inputs, targets = pad_collate(shard[start:start + 32])
        loss_sum, num_tokens = token_loss(model(inputs.to(device)), targets.to(device))
        totals[0] += loss_sum.double()
        totals[1] += num_tokens
    loss_sum, num_tokens = all_reduce_sum(totals).tolist()
    return loss_sum / max(num_tokens, 1.0)


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
    num_epochs = cfg.NUM_EPOCHS if args.epochs is None else args.epochs

    lines = read_lines()
    vocab = Vocabulary("".join(lines))
    samples = build_samples(lines, vocab)
    baseline = unigram_entropy(samples)
    num_chars = sum(len(y) for _, y in samples)
    logger.info(f"{len(lines)} lines, {num_chars} target characters, vocabulary of {len(vocab)} (padding included)",
                ranks=[0])
    if rank == 0:
        print(f"unigram baseline: {baseline:.4f}", flush=True)

    train_loader = get_dataloader(samples, shuffle=True, seed=1024, batch_size=cfg.BATCH_SIZE, collate_fn=pad_collate)
    model = CharGRU(len(vocab), embed=cfg.EMBED, hidden=cfg.HIDDEN)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.LR)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=max(num_epochs, 1))  # stepped once per epoch
    engine, train_loader, _, lr_scheduler = colossal_lite.initialize(model, optimizer, token_loss, train_loader,
                                                                     lr_scheduler=lr_scheduler)

    for epoch in range(num_epochs):
        engine.train()
        totals = torch.zeros(2, device=device)  # loss sum, real tokens; on the device, read once per epoch
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            engine.zero_grad()
            logits = engine(inputs)
            loss = engine.criterion(logits, targets)  # this micro-batch's per-token mean
            engine.backward(loss)
            engine.step()  # updates every gradient_accumulation micro-batches
            num_tokens = (targets != IGNORE_INDEX).sum()
            totals[0] += loss.detach() * num_tokens
            totals[1] += num_tokens
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        loss_sum, tokens = all_reduce_sum(totals).tolist()  # on every rank: it is a collective
        logger.info(f"epoch {epoch + 1}/{num_epochs} - train per-token loss: {loss_sum / max(tokens, 1.0):.4f}, "
                    f"lr: {lr:.4g}", ranks=[0])

    final = evaluate(engine.unwrapped_model, samples, rank, world_size, device)
    if rank == 0:
        print(f"trained on {world_size} process(es) in {time.perf_counter() - start:.1f} s", flush=True)
        print(f"greedy sample: {greedy_sample(engine.unwrapped_model, vocab, cfg.SAMPLE_PROMPT, cfg.SAMPLE_CHARS)!r}",
              flush=True)
        print(f"final per-token loss: {final:.4f}", flush=True)
    gpc.destroy()
    if args.require_loss_below is not None and not final < args.require_loss_below:
        if rank == 0:
            print(f"final per-token loss {final:.4f} is not below the required {args.require_loss_below}",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
