"""pytorch/examples' word_language_model, small: an LSTM language model whose hidden state is carried from batch to
batch (detached between batches), clipped, trained by hand and under ``Trainer.fit`` with a step of the user's own.

The ported parts keep the original's names and shape (``Dictionary``/``Corpus`` tokenising text, ``batchify``,
``get_batch``, ``RNNModel``, ``repackage_hidden``, ``train``/``evaluate``). Smallest honest diffs: the text is
generated (nothing is downloaded), the model is tiny, dropout is 0 (both loops would draw the same masks, but the
comparison then rests on the RNG only), and ``torch.optim.SGD`` replaces the original's hand update
``p.data.add_(p.grad, alpha=-lr)``, which computes the same ``p - lr * grad``. On several ranks each rank trains
on its own columns of the batchified text, the hand loop with DDP around the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colossal_lite.trainer.hooks import BaseHook

BSZ, EVAL_BSZ, BPTT, EMSIZE, NHID, NLAYERS, LR, CLIP, EPOCHS = 4, 2, 5, 8, 12, 2, 2.0, 0.25, 2


class Dictionary:
    def __init__(self):
        self.word2idx, self.idx2word = {}, []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


def generated_text(lines: int, seed: int):
    """Sentences of a small made-up language (a word followed by one of its few successors), one per line."""
    g = torch.Generator().manual_seed(seed)
    words = [f"w{i}" for i in range(20)]
    out = []
    for _ in range(lines):
        w = int(torch.randint(0, 20, (1,), generator=g))
        sentence = []
        for _ in range(int(torch.randint(3, 9, (1,), generator=g))):
            sentence.append(words[w])
            w = (w * 7 + int(torch.randint(0, 3, (1,), generator=g))) % 20
        out.append(" ".join(sentence))
    return out


class Corpus:
    def __init__(self):
        self.dictionary = Dictionary()
        self.train = self.tokenize(generated_text(40, seed=1))
        self.valid = self.tokenize(generated_text(12, seed=2))

    def tokenize(self, lines):
        ids = []
        for line in lines:
            ids += [self.dictionary.add_word(word) for word in line.split() + ["<eos>"]]
        return torch.tensor(ids, dtype=torch.int64)


def batchify(data, bsz, rank=0, world=1):
    """The original's columns, ``bsz`` per rank; this rank's."""
    nbatch = data.size(0) // (bsz * world)
    data = data.narrow(0, 0, nbatch * bsz * world)
    return data.view(bsz * world, -1).t().contiguous()[:, rank * bsz:(rank + 1) * bsz].contiguous()


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


class RNNModel(nn.Module):
    def __init__(self, ntoken):
        super().__init__()
        self.ntoken = ntoken
        self.encoder = nn.Embedding(ntoken, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, NLAYERS)
        self.decoder = nn.Linear(NHID, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(NLAYERS, bsz, NHID), weight.new_zeros(NLAYERS, bsz, NHID))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def build(rank=0, world=1):
    corpus = Corpus()
    torch.manual_seed(0)
    model = RNNModel(len(corpus.dictionary))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_data = batchify(corpus.train, BSZ, rank, world)
    val_data = batchify(corpus.valid, EVAL_BSZ, rank, world)
    return model, optimizer, train_data, val_data


def batches(source):
    return [get_batch(source, i) for i in range(0, source.size(0) - 1, BPTT)]


def hand(rank=0, world=1):
    """The original's train() and evaluate() for EPOCHS epochs. Returns (model, train losses, per-epoch
    (validation loss sum weighted by sequence length, positions))."""
    model, optimizer, train_data, val_data = build(rank, world)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
    criterion = nn.NLLLoss()
    losses, evals = [], []
    for _ in range(EPOCHS):
        net.train()
        hidden = model.init_hidden(BSZ)
        for data, targets in batches(train_data):
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = net(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            losses.append(loss.item())
        evals.append(evaluate_by_hand(net, model, criterion, val_data))
    return model, losses, evals


def evaluate_by_hand(net, model, criterion, data_source):
    net.eval()
    total_loss, positions = 0.0, 0
    hidden = model.init_hidden(EVAL_BSZ)
    with torch.no_grad():
        for data, targets in batches(data_source):
            output, hidden = net(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
            positions += len(data)
    return total_loss, positions


class LanguageModelStep(BaseHook):
    """The original's train() body, one batch at a time, for ``fit(step=UserStep(lm.train, evaluate=lm.evaluate),
    hooks=[lm, ...])``: the hidden state lives here between batches and starts afresh with each epoch (the train
    function sees ``batch_idx == 0``) and each evaluation (this hook's ``before_test_epoch``)."""

    def __init__(self, engine):
        super().__init__(priority=0)
        self.engine = engine
        self.hidden = self.eval_hidden = None

    def train(self, trainer, batch):
        data, targets = batch
        engine = self.engine
        if trainer.state.batch_idx == 0:  # the original's init_hidden at the start of train()
            self.hidden = engine.unwrapped_model.init_hidden(BSZ)
        engine.zero_grad()
        self.hidden = repackage_hidden(self.hidden)
        output, self.hidden = engine(data, self.hidden)
        loss = engine.criterion(output, targets)
        engine.backward(loss)
        engine.step()  # (clipping is this engine's own feature: initialize(..., config=dict(clip_grad_norm=CLIP)))
        return output, targets, loss

    def before_test_epoch(self, trainer):
        self.eval_hidden = self.engine.unwrapped_model.init_hidden(EVAL_BSZ)

    def evaluate(self, trainer, batch):
        data, targets = batch
        output, hidden = self.engine(data, self.eval_hidden)
        self.eval_hidden = repackage_hidden(hidden)
        return output, targets, self.engine.criterion(output, targets)


class LossRecorder(BaseHook):
    """This rank's training loss of every iteration, read to a Python float (a test reads them all)."""

    def __init__(self):
        super().__init__(priority=100)
        self.losses = []

    def after_train_iter(self, trainer, output, label, loss):
        self.losses.append(float(loss.detach()))


def library(rank=0, world=1):
    """The same program under ``Trainer.fit`` with a step of the user's own. Returns (model, train losses, the
    test Loss of each epoch as LossHook computed it over all ranks)."""
    import colossal_lite
    from colossal_lite.trainer import Trainer, UserStep
    from colossal_lite.trainer.hooks import LossHook

    model, optimizer, train_data, val_data = build(rank, world)
    engine, *_ = colossal_lite.initialize(model, optimizer, nn.NLLLoss(), config=dict(clip_grad_norm=CLIP),
                                          verbose=False)
    lm, recorder = LanguageModelStep(engine), LossRecorder()
    trainer = Trainer(engine)
    history = trainer.fit(batches(train_data), epochs=EPOCHS, test_dataloader=batches(val_data),
                          step=UserStep(lm.train, evaluate=lm.evaluate), hooks=[lm, LossHook(), recorder],
                          log_dir=False)
    return engine.unwrapped_model, recorder.losses, history["test/Loss"]


def differences(rank=0, world=1) -> dict:
    """Parameters and buffers that differ between the two runs, the losses of both, and both validation losses."""
    hand_model, hand_losses, hand_evals = hand(rank, world)
    lib_model, lib_losses, lib_test_loss = library(rank, world)
    theirs = dict(list(lib_model.named_parameters()) + list(lib_model.named_buffers()))
    differ = {name: float((t.double() - theirs[name].double()).abs().max())
              for name, t in list(hand_model.named_parameters()) + list(hand_model.named_buffers())
              if not torch.equal(t, theirs[name])}
    return dict(differ=differ, hand_losses=hand_losses, lib_losses=lib_losses, hand_evals=hand_evals,
                lib_test_loss=lib_test_loss)
