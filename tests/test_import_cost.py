"""``import colossal_lite`` stays cheap: torchvision, rich and psutil are imported only when used."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """\
import json, sys
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
heavy = ("torchvision", "rich", "psutil")
after_import = [m for m in heavy if m in sys.modules]
get_dist_logger().info("a log line on a pipe")  # plain output: still no rich
after_log = [m for m in heavy if m in sys.modules]
print(json.dumps(dict(after_import=after_import, after_log=after_log)))
"""


def test_import_does_not_load_torchvision_rich_or_psutil():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict(after_import=[], after_log=[]), result


NN_PROBE = """\
import json, sys
import colossal_lite.nn
loaded = [m for m in ("colossal_lite.nn.lr_scheduler", "colossal_lite.nn.metric") if m in sys.modules]
from colossal_lite.registry import LR_SCHEDULERS
found = LR_SCHEDULERS.get_module("CosineAnnealingWarmupLR").__module__
from colossal_lite.nn import Accuracy, LinearWarmupLR
print(json.dumps(dict(loaded=loaded, found=found, names=[LinearWarmupLR.__name__, Accuracy.__name__])))
"""


def test_nn_loads_schedulers_and_metrics_on_first_use_and_the_registry_finds_them():
    proc = subprocess.run([sys.executable, "-c", NN_PROBE], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # legacy registered the schedulers at ``import colossalai``: a lookup finds them without importing them first
    assert result == dict(loaded=[], found="colossal_lite.nn.lr_scheduler.cosine",
                          names=["LinearWarmupLR", "Accuracy"]), result
