"""Legacy Colossal-AI's ``tests/test_engine/test_engine.py``, ported mechanically: imports renamed, CUDA -> CPU,
nccl -> gloo, apex (not supported) left out of the modes, and the shared test models
(``tests.components_to_test``) written here at a small size. It runs the legacy helpers
``parameterize`` + ``spawn`` + ``rerun_if_address_is_in_use`` around ``launch`` and ``initialize``."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.core import global_context as gpc
from colossal_lite.testing import parameterize, rerun_if_address_is_in_use, spawn

CONFIG = dict(parallel=dict(pipeline=dict(size=1), tensor=dict(size=1, mode=None)),
              fp16=dict(mode=None),
              clip_grad_norm=1.0)


# -- the shared components of the legacy tests, small ----------------------------------------------
class NetWithRepeatedlyComputedLayers(nn.Module):
    """A layer used more than once in one forward (legacy ``repeated_computed_layers``)."""

    def __init__(self, checkpoint=False):
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 5)
        self.fc3 = nn.Linear(5, 2)
        self.layers = [self.fc1, self.fc2, self.fc1, self.fc2, self.fc3]

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SmallConvNet(nn.Module):
    """Stands in for legacy ``resnet18`` (a conv net on images), at a size a CPU test affords."""

    def __init__(self, checkpoint=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _components(model_name):
    gen = torch.Generator().manual_seed(0)
    if model_name == "repeated_computed_layers":
        data = TensorDataset(torch.randn(16, 5, generator=gen), torch.randint(0, 2, (16,), generator=gen))
        builder = NetWithRepeatedlyComputedLayers
    else:
        data = TensorDataset(torch.randn(16, 3, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen))
        builder = SmallConvNet
    return builder, DataLoader(data, batch_size=4), None, torch.optim.Adam, nn.CrossEntropyLoss()


@parameterize('model_name', ['repeated_computed_layers', 'resnet18', 'repeated_computed_layers'])
@parameterize('amp_mode', [AMP_TYPE.TORCH, AMP_TYPE.NAIVE, None])
def run_train(model_name, amp_mode):
    gpc.config.fp16['mode'] = amp_mode
    model_builder, train_dataloader, _, optimizer_class, criterion = _components(model_name)

    model = model_builder(checkpoint=False)
    engine, train_dataloader, *args = colossal_lite.initialize(model=model,
                                                               optimizer=optimizer_class(model.parameters(), lr=1e-3),
                                                               criterion=criterion,
                                                               train_dataloader=train_dataloader,
                                                               verbose=False)

    engine.train()
    for data, label in train_dataloader:
        engine.zero_grad()
        if criterion:
            output = engine(data)
            loss = engine.criterion(output, label)
        else:
            loss = engine(data, label)
        engine.backward(loss)
        updated = engine.step()
        # (the port's own checks: legacy's test only ran the step)
        assert torch.isfinite(loss).all(), f"{model_name}, {amp_mode}: loss {loss}"
        assert updated or engine.loss_scale is not None, f"{model_name}, {amp_mode}: no update and no loss scaler"
        break


def run_engine(rank, world_size, port):
    # init dist env
    colossal_lite.launch(config=CONFIG, rank=rank, world_size=world_size, host='localhost', port=port, backend='gloo',
                         verbose=False)
    run_train()


@pytest.mark.dist
@rerun_if_address_is_in_use()
def test_engine():
    spawn(run_engine, 2)


if __name__ == '__main__':
    test_engine()
