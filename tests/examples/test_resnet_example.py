"""The ResNet/CIFAR-10 example runs end to end on synthetic data (no download) in one process."""
import re

from dist_helpers import REPO, run_python
from optional_packages import require_torchvision

SCRIPT = REPO / "examples" / "resnet_cifar10" / "train_engine.py"


def test_resnet_example_runs_two_synthetic_steps():
    require_torchvision("the ResNet example needs torchvision")
    proc = run_python(SCRIPT, ["--synthetic", "--max-steps", "2", "--batch-size", "4"], timeout=180)
    assert re.search(r"trained 2 steps per process on 1 process\(es\); final test accuracy: [0-9.]+", proc.stdout), \
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Epoch 0 - train loss:" in proc.stdout
