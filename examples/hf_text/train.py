"""Train a tiny GPT-2 (built from its config: random weights, nothing downloaded) on the Zen of Python with the
Trainer, bf16, gradient accumulation and ZeRO; the model computes its own loss, so there is no criterion.

One process:   python examples/hf_text/train.py
Two processes: python -m torch.distributed.run --nproc_per_node 2 examples/hf_text/train.py

The text is the one Python ships in its ``this`` module, read character by character (the vocabulary is its
characters, so no tokenizer is needed). Every batch is a dict ``{'input_ids', 'labels'}`` as a Hugging Face
collator gives it; ``model(**batch)`` returns a ``CausalLMOutput`` whose ``loss`` the engine trains on. Rank 0
prints ``unigram baseline: Y`` (the entropy of the character frequencies, in nats), the metrics of each epoch,
then a greedy sample and ``final eval loss: X``. ``--out DIR`` keeps the last checkpoint in DIR/checkpoints and the model's config.json
in DIR, for ``colossal-lite ckpt export DIR/checkpoints OUT --hf DIR``.
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import io
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer, hooks
from colossal_lite.utils import get_dataloader

CONFIG = Path(__file__).resolve().with_name("config.py")
PROMPT = "Beautiful is "


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="config file (default: config.py next to this script)")
    parser.add_argument("--epochs", type=int, default=None, help="passes over the text (default: NUM_EPOCHS)")
    parser.add_argument("--out", default=None, metavar="DIR", help="keep checkpoints and the model's config here")
    return parser.parse_args()


def zen_of_python() -> str:
    """The text Python ships in ``this`` (stored rot13-encoded there; importing the module prints it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13")


def windows(ids: torch.Tensor, seq_len: int, stride: int):
    """Samples as a Hugging Face dataset holds them: the model shifts ``labels`` by one itself."""
    return [dict(input_ids=ids[i:i + seq_len], labels=ids[i:i + seq_len])
            for i in range(0, len(ids) - seq_len + 1, stride)]


def unigram_entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log(n / len(text)) for n in counts.values())


def build_model(vocab_size: int, cfg) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=vocab_size, n_positions=cfg.SEQ_LEN, n_embd=cfg.EMBED, n_layer=cfg.LAYERS,
                        n_head=cfg.HEADS, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM",
                        architectures=["GPT2LMHeadModel"])
    return GPT2LMHeadModel(config)


def shifted_logits(output):
    """Accuracy of the next character: the logits of every position but the last, flattened."""
    return output.logits[:, :-1].flatten(0, 1)


def shifted_labels(labels):
    return labels[:, 1:].flatten()


@torch.no_grad()
def greedy(model, vocab, prompt: str, length: int) -> str:
    ids = torch.tensor([[vocab.index(c) for c in prompt]])
    for _ in range(length):
        logits = model(input_ids=ids[:, -model.config.n_positions:]).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return "".join(vocab[i] for i in ids[0].tolist())


def final_model(engine, vocab_size: int, cfg) -> GPT2LMHeadModel:
    """The trained weights in a plain model (every rank calls it: with ZeRO the full weights are gathered)."""
    state = engine.state_dict()["model"]
    model = build_model(vocab_size, cfg)
    model.load_state_dict(state)
    return model.eval()


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    colossal_lite.launch_from_torch(config=args.config, seed=1024)
    torch.set_num_threads(1)  # tiny layers: extra OpenMP threads cost more than they give on the CPU
    cfg, rank = gpc.config, gpc.get_global_rank()
    text = zen_of_python()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    samples = windows(ids, cfg.SEQ_LEN, cfg.STRIDE)
    if rank == 0:
        print(f"unigram baseline: {unigram_entropy(text):.4f}\n", end="", flush=True)

    model = build_model(len(vocab), cfg)
    train_loader = get_dataloader(samples, shuffle=True, seed=1024, batch_size=cfg.BATCH_SIZE)
    test_loader = get_dataloader(samples, batch_size=cfg.BATCH_SIZE)
    engine, train_loader, test_loader, _ = colossal_lite.initialize(
        model, lambda params: torch.optim.AdamW(params, lr=cfg.LR), None, train_loader, test_loader)
    fit_hooks = [hooks.LossHook(), hooks.LogMetricByEpochHook(),
                 hooks.AccuracyHook(Accuracy(), logits_from=shifted_logits, labels_from=shifted_labels)]
    if args.out:
        fit_hooks.append(hooks.SaveCheckpointHook(checkpoint_dir=str(Path(args.out) / "checkpoints"), keep_last_n=1))
    trainer = Trainer(engine)
    trainer.fit(train_loader, epochs=cfg.NUM_EPOCHS if args.epochs is None else args.epochs,
                test_dataloader=test_loader, hooks=fit_hooks, display_progress=False)
    final = trainer.states["metrics"]["test"]["Loss"].get_accumulated_value()
    trained = final_model(engine, len(vocab), cfg)
    if rank == 0:
        if args.out:
            trained.config.save_pretrained(args.out)
            probe = ids[: cfg.SEQ_LEN].unsqueeze(0)
            torch.save(dict(input_ids=probe, logits=trained(input_ids=probe).logits), Path(args.out) / "probe.pt")
        print(f"trained on {gpc.get_world_size()} process(es) in {time.perf_counter() - start:.1f} s\n", end="",
              flush=True)
        print(f"greedy sample: {greedy(trained, vocab, PROMPT, 40)!r}\n", end="", flush=True)
        print(f"final eval loss: {final:.4f}\n", end="", flush=True)
    gpc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
