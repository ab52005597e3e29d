"""Legacy Colossal-AI's ``tests/test_engine/test_gradient_accumluation.py``, ported mechanically: imports renamed,
CUDA -> CPU, nccl -> gloo, CIFAR10 (a download) -> torchvision's FakeData of the same shape, 4 processes -> 2.
It uses ``spawn`` and ``rerun_if_address_is_in_use`` around ``launch``, ``get_dataloader`` and ``initialize``."""
import pytest
import torch
import torch.nn as nn
from optional_packages import require_torchvision
from torch.optim import Adam

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
from colossal_lite.testing import rerun_if_address_is_in_use, spawn
from colossal_lite.utils import get_dataloader

# imported through the helper, so that a torchvision that does not match torch skips this module with the reason
# instead of stopping the whole run at collection
torchvision = require_torchvision("this port uses torchvision's FakeData and resnet18", module_level=True)
transforms, FakeData, resnet18 = torchvision.transforms, torchvision.datasets.FakeData, torchvision.models.resnet18

# Config
BATCH_SIZE = 2
NUM_CLASSES = 10

CONFIG = dict(parallel=dict(pipeline=dict(size=1), tensor=dict(size=1, mode=None)),
              clip_grad_norm=1.0,
              gradient_accumulation=4)


def run_no_pipeline(rank, world_size, port):

    # init dist env
    colossal_lite.launch(config=CONFIG, rank=rank, world_size=world_size, host='localhost', port=port, backend='gloo',
                         verbose=False)

    # build model
    model = resnet18(num_classes=10)

    # build dataloaders
    train_dataset = FakeData(size=64, image_size=(3, 32, 32), num_classes=NUM_CLASSES,
                             transform=transforms.Compose([
                                 transforms.ToTensor(),
                                 transforms.Normalize(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
                             ]))
    train_dataloader = get_dataloader(dataset=train_dataset,
                                      shuffle=True,
                                      batch_size=BATCH_SIZE,
                                      pin_memory=False,
                                      drop_last=True)

    # build optimizer
    optimizer = Adam(model.parameters(), lr=0.001)
    criterion = nn.CrossEntropyLoss()

    engine, train_dataloader, *args = colossal_lite.initialize(model=model,
                                                               optimizer=optimizer,
                                                               criterion=criterion,
                                                               train_dataloader=train_dataloader,
                                                               verbose=False)
    logger = get_dist_logger()  # noqa: F841
    rank = torch.distributed.get_rank()
    param_track = []
    grad_track = []
    next(model.parameters()).retain_grad()

    engine.train()
    step = 0
    for img, label in train_dataloader:
        engine.zero_grad()
        output = engine(img)
        loss = engine.criterion(output, label)
        engine.backward(loss)
        engine.step()

        # check
        param_track.append(next(model.parameters())[0].clone())
        grad_track.append(next(model.parameters()).grad[0].clone())
        step += 1
        if step == CONFIG['gradient_accumulation']:
            break

    assert not torch.all(grad_track[0] == grad_track[-1]), 'grad should be different in different iterations'
    assert torch.all(param_track[0] == param_track[1]) and not torch.all(param_track[0] == param_track[-1]), \
        'param should be the same in the first few iterations and only changed in the last iteration'

    gpc.destroy()


@pytest.mark.dist
@rerun_if_address_is_in_use()
def test_engine():
    spawn(run_no_pipeline, 2)


if __name__ == '__main__':
    test_engine()
