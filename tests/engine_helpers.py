"""Small models and data shared by engine tests."""
import torch


def make_model(seed=0, din=6, dh=12, dout=4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(din, dh), torch.nn.Tanh(), torch.nn.Linear(dh, dout))


def make_batches(n, b=4, din=6, dout=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, din, generator=g), torch.randint(0, dout, (b,), generator=g)) for _ in range(n)]
