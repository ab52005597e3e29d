"""Tiny Hugging Face models (GPT-2 and BERT built from their configs, random weights) trained by hand and through
colossal_lite the way their users write it, side by side.

Used by ``engine/test_hf_model_loss.py``: in the test process for one process, and as a torchrun script
(``python -m torch.distributed.run --nproc_per_node 2 hf_loop.py OUT``) for the data-parallel kinds. Each case is
one row of issue 33's table, with accumulation 2 over 5 micro-batches (a partial last window) and clipping:

- ``own-loss``: no criterion, the model computes its loss from the batch's ``labels``
- ``logits-criterion``: ``criterion=lambda out, y: F.cross_entropy(out.logits, y)`` on a ``ModelOutput``
- ``accuracy``: no criterion, ``AccuracyHook`` on the ``ModelOutput``'s logits (train and evaluation)
- ``tuple``: ``config.return_dict=False``, the loss as the tuple's first item, no criterion
- ``tuple-criterion``: ``config.return_dict=False``, the labels apart, ``criterion=nn.CrossEntropyLoss()``
- ``token-mean``: no criterion, ``grad_reduction='per-token-mean'`` with the batch's token count

The hand loop is what torch's documentation says to write: ``no_sync`` around a micro-batch that does not end its
window (FSDP2: ``set_requires_gradient_sync``), the loss divided by its window's real size, autocast for bf16 and
fp16, ``GradScaler`` for fp16, ``clip_grad_norm_(model.parameters())``. Every collective either loop makes is counted per micro-step
(``exact_loop.CollectiveCounter``: the ``torch.distributed`` calls from Python, DDP's gradient buckets).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import exact_loop
import torch
import torch.distributed as dist
import torch.nn.functional as F
from exact_loop import CollectiveCounter

VOCAB, SEQ, CLASSES = 40, 8, 3
MICRO_BATCHES, ACC, LR = 5, 2, 0.05
CLIP, INIT_SCALE = exact_loop.CLIP, exact_loop.INIT_SCALE  # the matrix test's, so its config serves here too
ROWS = ("own-loss", "logits-criterion", "accuracy", "tuple", "tuple-criterion", "token-mean")
CLASSIFIER_ROWS = ("logits-criterion", "accuracy", "tuple", "tuple-criterion")  # BERT; the others train GPT-2


def gpt2(return_dict: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, return_dict=return_dict)
    return GPT2LMHeadModel(config)


def bert(return_dict: bool = True):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=CLASSES, return_dict=return_dict)
    return BertForSequenceClassification(config)


def model_for(row: str):
    return bert(return_dict=not row.startswith("tuple")) if row in CLASSIFIER_ROWS else gpt2()


def batches(row: str, rank: int):
    """The micro-batches of ``rank``: dicts as a Hugging Face collator gives them. Language-model labels are padded
    with -100 at different lengths, so micro-batches hold different numbers of real tokens."""
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for i in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        if row in CLASSIFIER_ROWS:
            mask = torch.ones(2, SEQ, dtype=torch.long)
            mask[1, SEQ - 1 - i % 3:] = 0
            out.append(dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, CLASSES, (2,), generator=g)))
        else:
            labels = ids.clone()
            labels[0, SEQ - 1 - i:] = -100
            out.append(dict(input_ids=ids, labels=labels))
    return out


def lm_tokens(batch) -> torch.Tensor:
    """Real tokens a causal language model's loss is the mean over: the labels shifted by one, padding left out."""
    return (batch["labels"][:, 1:] != -100).sum()


def split_labels(batch):
    """``data_process_func`` of the criterion row: the inputs to the model, the labels to the criterion."""
    return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]


def windows(n: int = MICRO_BATCHES, acc: int = ACC):
    """(first, last, divisor) of each micro-batch: windows of ``acc`` from the epoch's start, the last one partial."""
    out = []
    for i in range(n):
        start = i - i % acc
        size = min(acc, n - start)
        out.append((i == start, i == start + size - 1, size))
    return out


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# -- the hand-written loop ---------------------------------------------------------------------------------------
def wrap_by_hand(model, parallel: str, counter: CollectiveCounter):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if world() > 1 and parallel in ("ddp", "zero1"):
        ddp = DDP(model, gradient_as_bucket_view=parallel == "zero1")
        ddp.register_comm_hook(None, counter.ddp_hook)
        return ddp
    if parallel in ("zero2", "zero3"):
        from torch.distributed.fsdp import fully_shard

        blocks = model.transformer.h if hasattr(model, "transformer") else model.bert.encoder.layer
        for block in blocks:
            fully_shard(block, reshard_after_forward=parallel == "zero3")
        fully_shard(model, reshard_after_forward=parallel == "zero3")
    return model


def hand_optimizer(model, parallel: str):
    inner = getattr(model, "module", model)
    if parallel == "zero1" and world() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(inner.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return torch.optim.AdamW(inner.parameters(), lr=LR)


def hand_loss(row: str, model, batch):
    """The micro-batch's loss as the Hugging Face user writes it (and the token count for the token row)."""
    if row == "logits-criterion":
        inputs, y = split_labels(batch)
        return F.cross_entropy(model(**inputs).logits, y), None
    if row == "tuple":
        return model(**batch)[0], None
    if row == "tuple-criterion":
        inputs, y = split_labels(batch)
        return F.cross_entropy(model(**inputs)[0], y), None
    return model(**batch).loss, lm_tokens(batch) if row == "token-mean" else None


def hand_loop(row: str, prec: str, parallel: str, rank: int, counter: CollectiveCounter):
    """Returns (model, losses). The token row weighs each micro-batch's mean loss by its real tokens and divides the
    window's sum by the window's tokens over every rank, as a per-token mean over the global batch is written when
    the window's count is known only at its end; the weights carry a power of two near 1 / the last window's tokens
    per rank (``unit``), which keeps fp16 loss scaling's gradients of a per-token mean's size."""
    model = wrap_by_hand(model_for(row), parallel, counter)
    optimizer = hand_optimizer(model, parallel)
    dtype = dict(fp32=None, bf16=torch.bfloat16, fp16=torch.float16)[prec]
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=prec == "fp16")
    losses, tokens, unit = [], None, torch.ones(())
    for batch, (first, last, size) in zip(batches(row, rank), windows()):
        counter.begin()
        if first:
            optimizer.zero_grad(set_to_none=True)
            tokens = torch.zeros(())
        if parallel in ("zero2", "zero3"):
            model.set_requires_gradient_sync(last)
        sync = model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext()
        with sync:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss, n = hand_loss(row, model, batch)
            if n is None:
                scaler.scale(loss / size).backward()
            else:
                scaler.scale(loss * (n * unit)).backward()
                tokens += n
        losses.append(float(loss.detach().float()))
        if last:
            if row == "token-mean":
                total = tokens.clone()
                if world() > 1:
                    dist.all_reduce(total)
                for p in model.parameters():
                    p.grad.mul_(world() / total / unit)
                unit = torch.exp2(-torch.floor(torch.log2((total / world()).clamp(min=1))))
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(optimizer)
            scaler.update()
        counter.end()
    return model, losses


# -- the same through colossal_lite ------------------------------------------------------------------------------
def config_for(row: str, prec: str, parallel: str) -> dict:
    """The matrix test's config for this precision and kind of parallelism (the same clipping and initial loss
    scale), with the row's reduction."""
    config = exact_loop.config_for(prec, parallel, ACC)
    if row == "token-mean":
        config["grad_reduction"] = "per-token-mean"
    return config


def library_parts(row: str):
    """(criterion, data_process_func) the user passes to ``initialize`` for the row."""
    from colossal_lite.engine import ModelLoss

    if row == "logits-criterion":
        return (lambda out, y: F.cross_entropy(out.logits, y)), split_labels
    if row == "token-mean":
        return ModelLoss(num_tokens=lm_tokens), None
    if row == "tuple-criterion":
        return torch.nn.CrossEntropyLoss(), split_labels
    return None, None


def library_loop(row: str, prec: str, parallel: str, loop: str, rank: int, counter: CollectiveCounter):
    """The case through ``initialize`` and the engine loop or ``Trainer.fit``. Returns (engine, losses, metrics)."""
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer import Trainer, hooks

    gpc.load_config(config_for(row, prec, parallel))
    criterion, data_process_func = library_parts(row)
    model = model_for(row)
    engine, loader, _, _ = colossal_lite.initialize(model, lambda params: torch.optim.AdamW(params, lr=LR), criterion,
                                                    batches(row, rank), data_process_func=data_process_func,
                                                    verbose=False)
    if hasattr(engine.model, "register_comm_hook"):  # DDP (ZeRO 1 too)
        engine.model.register_comm_hook(None, counter.ddp_hook)
    losses = []
    if loop == "engine":  # the Hugging Face user's own loop
        for batch in loader:
            counter.begin()
            engine.zero_grad()
            if data_process_func is None:
                out = engine(**batch)
                loss = out[0] if row == "tuple" else out.loss
            else:
                inputs, y = data_process_func(batch)
                out = engine(**inputs)
                loss = engine.criterion(out[0] if row == "tuple-criterion" else out, y)
            engine.backward(loss, num_tokens=lm_tokens(batch) if row == "token-mean" else None)
            engine.step()
            counter.end()
            losses.append(float(loss.detach().float()))
        return engine, losses, {}

    class Record(hooks.BaseHook):
        def before_train_iter(self, trainer):
            counter.begin()

        def after_train_iter(self, trainer, output, label, loss):
            counter.end()
            losses.append(float(loss.detach().float()))

    trainer = Trainer(engine)
    extra = [hooks.AccuracyHook(Accuracy(), track_train=True), hooks.LossHook()] if row == "accuracy" else []
    trainer.fit(loader, epochs=1, hooks=[Record(), *extra], display_progress=False,
                test_dataloader=batches(row, rank + 100) if row == "accuracy" else None)
    metrics = {f"{phase}/{name}": m.get_accumulated_value() for phase in ("train", "test")
               for name, m in trainer.states["metrics"][phase].items() if name in ("Accuracy", "Loss")}
    return engine, losses, metrics


# -- comparing ---------------------------------------------------------------------------------------------------
def full_state(model) -> dict:
    """Parameters and buffers as full tensors (FSDP2's DTensors gathered: a collective)."""
    out = {}
    inner = getattr(model, "module", model)
    for name, t in list(inner.named_parameters()) + list(inner.named_buffers()):
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().clone()
    return out


@torch.no_grad()
def hand_metrics(model, rank: int) -> dict:
    """Accuracy and loss of the trained hand model on the test batches of every rank, as the hook computes them:
    correct predictions and sample-weighted losses summed over all ranks."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # correct, samples, loss * samples
    for batch in batches("accuracy", rank + 100):
        out = model(**batch)
        sums += torch.stack([(out.logits.argmax(-1) == batch["labels"]).sum().double(), torch.tensor(2.0),
                             out.loss.double() * 2])
    if world() > 1:
        dist.all_reduce(sums)
    return {"test/Accuracy": float(sums[0] / sums[1]), "test/Loss": float(sums[2] / sums[1])}


def compare(row: str, prec: str, parallel: str, loop: str, rank: int) -> dict:
    """One case, the library against the hand loop: the tensors that differ (and by how much), losses, metrics."""
    hand_counter, lib_counter = CollectiveCounter(), CollectiveCounter()
    with hand_counter.patched():
        hand_model, hand_losses = hand_loop(row, prec, parallel, rank, hand_counter)
    with lib_counter.patched():
        engine, lib_losses, metrics = library_loop(row, prec, parallel, loop, rank, lib_counter)
    hand, lib = full_state(hand_model), full_state(engine.unwrapped_model)
    differ = {n: float((hand[n].double() - lib[n].double()).abs().max()) for n in hand if not torch.equal(hand[n], lib[n])}
    result = dict(differ=differ, names=sorted(hand), hand_losses=hand_losses, lib_losses=lib_losses,
                  strategy=engine.strategy.name, metrics=metrics, hand_collectives=hand_counter.steps,
                  lib_collectives=lib_counter.steps)
    if row == "accuracy" and loop == "trainer":
        result["hand_metrics"] = hand_metrics(getattr(hand_model, "module", hand_model), rank)
    return result


def run_all(cases, rank: int) -> dict:
    results = {}
    for case in cases:
        key = "/".join(case)
        try:
            results[key] = compare(*case, rank)
        except Exception as e:
            results[key] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    return results


# the data-parallel cases of the 2-rank launch: every row with DDP, ZeRO 1/2/3 with the model's own loss
DISTRIBUTED_CASES = [(row, "fp32", "ddp", "trainer") for row in ROWS] + [
    ("own-loss", "bf16", "ddp", "trainer"), ("own-loss", "fp16", "ddp", "trainer"), ("own-loss", "fp32", "ddp", "engine"),
    ("own-loss", "fp32", "zero1", "trainer"), ("own-loss", "fp32", "zero2", "trainer"),
    ("own-loss", "fp32", "zero3", "trainer"), ("own-loss", "fp32", "zero3", "engine"),
    ("token-mean", "fp32", "zero3", "trainer")]

if __name__ == "__main__":
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    colossal_lite.launch_from_torch(config={}, verbose=False)
    torch.set_num_threads(1)
    rank = gpc.get_global_rank()
    results = run_all(DISTRIBUTED_CASES, rank)
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump(results, f)
    gpc.destroy()
    os.environ.pop("MASTER_PORT", None)
