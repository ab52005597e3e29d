"""FLOPs counted once on meta tensors, against the count by hand; the peak table; MFU from a real fit."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SpeedReportHook
from colossal_lite.utils.flops import compute_kind, count_step_flops, lookup_peak_tflops, peak_flops

#: Counting the FLOPs runs the model under torch dispatch modes, whose first use in a process imports torch's
#: compiler front end (seconds): the tests that count are in the slow tier.
COUNTS = pytest.mark.slow


def mlp_hand_flops(widths, batch):
    """Training FLOPs of Linear layers ``widths[i] -> widths[i+1]``: forward 2*in*out per sample, backward twice
    that for the weight and input gradients, except the first layer's input, which needs no gradient."""
    pairs = list(zip(widths, widths[1:]))
    return batch * (6 * sum(i * o for i, o in pairs) - 2 * pairs[0][0] * pairs[0][1])


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d=32, layers=2, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(self.emb(x))).flatten(0, 1)


def lm_hand_flops(batch, tokens, vocab=50, d=32, layers=2):
    """Forward per sequence: each layer's Q, K, V and output projections 8*T*d^2, its MLP 16*T*d^2, attention
    scores and their product with V 4*T^2*d; the head 2*T*d*V. Training is three times the forward (the
    embedding is a lookup: no FLOPs, and its input needs no gradient)."""
    forward = layers * (24 * tokens * d * d + 4 * tokens * tokens * d) + 2 * tokens * d * vocab
    return 3 * batch * forward


@COUNTS
def test_mlp_flops_match_the_hand_count():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))
    counted = count_step_flops(model, torch.randn(8, 32), torch.randint(0, 10, (8,)), nn.functional.cross_entropy, 8)
    assert counted.flops == mlp_hand_flops([32, 64, 48, 10], 8)
    assert counted.flops_per_sample == counted.flops / 8
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())  # the model was not run


@COUNTS
def test_small_transformer_flops_within_5_percent_of_the_hand_count():
    x, y = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (32,))
    counted = count_step_flops(TinyLM(), x, y, nn.functional.cross_entropy, 2)
    assert counted.flops == pytest.approx(lm_hand_flops(2, 16), rel=0.05)


class TokenCrossEntropy(nn.CrossEntropyLoss):
    """(batch*tokens, vocab) logits against (batch, tokens) labels."""

    def forward(self, out, y):
        return super().forward(out, y.flatten())


def fit_mfu(model, data, batch_size, peak_tflops, criterion=None):
    torch.manual_seed(0)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                                    criterion or nn.CrossEntropyLoss(),
                                                    DataLoader(data, batch_size=batch_size), verbose=False)
    trainer = Trainer(engine)
    hook = SpeedReportHook(peak_tflops=peak_tflops, report=False, breakdown=False)
    trainer.fit(loader, epochs=1, hooks=[hook, LossHook()], log_dir=False)
    return hook, trainer.history


@COUNTS
def test_mfu_of_a_fit_within_5_percent_of_the_hand_count():
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    runs = [(fit_mfu(mlp, TensorDataset(torch.randn(32, 32), torch.randint(0, 10, (32,))), 8, 2.0),
             mlp_hand_flops([32, 64, 10], 1)),
            (fit_mfu(TinyLM(), TensorDataset(torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (8, 16))), 4, 2.0,
                     TokenCrossEntropy()), lm_hand_flops(1, 16))]
    for (hook, history), hand_per_sample in runs:
        sps = history["train/samples_per_s"][-1]
        assert history["train/mfu"][-1] == pytest.approx(hand_per_sample * sps / 2.0e12, rel=0.05)
        assert hook.figures.mfu == pytest.approx(hand_per_sample * hook.figures.samples_per_s / 2.0e12, rel=0.05)
        assert hook.flops.flops_per_sample == pytest.approx(hand_per_sample, rel=0.05)  # (a step's MFU: its
        # samples_per_s_step times this over the peak; the history keeps the throughput per step, MFU per epoch)


def test_peak_table_by_device_name_and_precision():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert lookup_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert lookup_peak_tflops("NVIDIA H100 NVL", "fp16") == 835.0
    assert lookup_peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert lookup_peak_tflops("NVIDIA H200 NVL", "tf32") == 417.5
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert lookup_peak_tflops("NVIDIA GeForce RTX 4090", "fp32") == 82.6
    assert lookup_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert lookup_peak_tflops("Some Future GPU", "bf16") is None


def test_compute_kind_follows_the_precision_and_torch_matmul_setting():
    assert compute_kind("bf16") == "bf16"
    assert compute_kind("torch_amp") == compute_kind("naive_amp") == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compute_kind("fp32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert compute_kind("fp32") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_peak_given_measured_or_said_plainly_missing():
    peak, note = peak_flops(torch.device("cpu"), "fp32", override_tflops=2.5)
    assert peak == 2.5e12 and note == "2.5 TFLOP/s given by the user"
    peak, note = peak_flops(torch.device("cpu"), "fp32", measure_cpu=False)
    assert peak is None and note == "no MFU: no peak known for a cpu device; give peak_tflops="
    peak, note = peak_flops(torch.device("cpu"), "fp32")
    assert peak > 1e8 and note.endswith("GFLOP/s measured by a float32 matrix product on this CPU")


@COUNTS
def test_a_model_that_reads_a_value_has_no_mfu_and_the_report_says_why():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            if x.sum().item() > 1e9:  # a value read: cannot run on meta tensors
                return self.lin(x) * 2
            return self.lin(x)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    hook, history = fit_mfu(Reads(), data, 8, 1.0)
    assert hook.flops is None and hook.figures.mfu is None
    assert hook.figures.peak_note.startswith("no MFU: the FLOPs could not be counted on meta tensors (")
    assert "give SpeedReportHook(flops_per_sample=...)" in hook.figures.peak_note
    assert "train/samples_per_s" in history
