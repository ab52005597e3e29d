"""Data, model and loss of the character-level language model example.

The text is ``data.txt`` next to this file, one sentence per line. Every line becomes one
sample: the input is a newline followed by the line's characters, the target is the same
characters followed by a newline (each position predicts the next character). Lines have
different lengths, so a batch is padded on the right: inputs with ``PAD_ID``, targets with
``IGNORE_INDEX`` (-100), which the loss skips.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

DATA_FILE = Path(__file__).resolve().with_name("data.txt")
PAD_ID = 0  # input id of padding positions (its embedding row stays zero)
IGNORE_INDEX = -100  # target of padding positions: no loss, no gradient, not counted
LINE_BREAK = "\n"  # starts every input line and ends every target line


class Vocabulary:
    """Character <-> id, in sorted order so that every process builds the same table. Id 0 is padding."""

    def __init__(self, text: str):
        chars = sorted(set(text) | {LINE_BREAK})
        self.itos: List[str] = ["<pad>"] + chars
        self.stoi: Dict[str, int] = {c: i for i, c in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> List[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.itos[i] for i in ids if i != PAD_ID)


def read_lines(path: Path = DATA_FILE) -> List[str]:
    """The non-empty lines of the text, stripped of surrounding white space."""
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_samples(lines: Sequence[str], vocab: Vocabulary) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """One ``(input ids, target ids)`` pair of int64 vectors per line, both ``len(line) + 1`` long."""
    samples = []
    for line in lines:
        ids = vocab.encode(LINE_BREAK + line + LINE_BREAK)
        samples.append((torch.tensor(ids[:-1]), torch.tensor(ids[1:])))
    return samples


def pad_collate(batch: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length samples into ``(inputs, targets)`` of shape (batch, longest line + 1), padded on the right."""
    inputs = nn.utils.rnn.pad_sequence([x for x, _ in batch], batch_first=True, padding_value=PAD_ID)
    targets = nn.utils.rnn.pad_sequence([y for _, y in batch], batch_first=True, padding_value=IGNORE_INDEX)
    return inputs, targets


def unigram_entropy(samples: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Entropy in nats per character of the target characters' frequencies.

    It is the loss of the best model that ignores context (it always predicts the
    character frequencies), measured on the same targets the evaluation scores.
    """
    counts = Counter()
    for _, target in samples:
        counts.update(target.tolist())
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values())


class CharGRU(nn.Module):
    """Embedding -> one GRU layer -> linear scores over the vocabulary, for every position."""

    def __init__(self, vocab_size: int, embed: int = 32, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed, padding_idx=PAD_ID)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor, state: torch.Tensor = None):
        """``ids`` (batch, time) -> logits (batch, time, vocab); with ``state`` given, also returns the new state.

        The GRU reads left to right, so the right padding never changes the scores of real positions.
        """
        out, new_state = self.gru(self.embed(ids), state)
        logits = self.head(out)
        return logits if state is None else (logits, new_state)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the cross-entropy over real tokens, number of real tokens)``: padding (-100) is left out of both.

    With ``grad_reduction='per-token-mean'`` the engine divides by the token count of the
    whole global batch (all micro-batches of an update, all ranks).
    """
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (target != IGNORE_INDEX).sum()


@torch.no_grad()
def greedy_sample(model: CharGRU, vocab: Vocabulary, prompt: str, max_chars: int = 80) -> str:
    """``prompt`` continued by always taking the most likely next character, until a newline or ``max_chars``."""
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([vocab.encode(LINE_BREAK + prompt)], device=device)
    state = torch.zeros(1, 1, model.gru.hidden_size, device=device)
    logits, state = model(ids, state)
    out = []
    for _ in range(max_chars):
        next_id = int(logits[0, -1].argmax())
        if vocab.itos[next_id] == LINE_BREAK:
            break
        out.append(next_id)
        logits, state = model(torch.tensor([[next_id]], device=device), state)
    return prompt + vocab.decode(out)
