"""``launch*(..., device='cpu')`` trains on the CPU on a machine with GPUs (nanoGPT's device='cpu', pytorch/examples'
--no-accel), and ``backend='nccl'`` in one process on the CPU is accepted with a warning: one process needs no
backend, and pytorch/examples' imagenet passes --dist-backend nccl by default."""
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_helpers import clean_launch_context, doc_python_blocks, run_python
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.launch import launch, launch_from_torch


@pytest.fixture(autouse=True)
def clean_context(monkeypatch):
    yield from clean_launch_context(monkeypatch)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def cuda_is_there(monkeypatch):
    """A machine that reports a GPU: with device='cpu' launch must not touch it (no torch.cuda call but this one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("launch(device='cpu') chose a GPU"))


def train_one_step():
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), make_batches(2), verbose=False)
    x, y = next(iter(loader))
    engine.backward(engine.criterion(engine(x), y))
    assert engine.step()
    return engine


def test_nccl_in_one_process_without_cuda_is_accepted_with_a_warning(no_cuda):
    with pytest.warns(UserWarning) as caught:
        launch_from_torch(config={}, backend="nccl", verbose=False)
    message = str(caught[0].message)
    assert message == ("backend='nccl' needs GPUs, but this process trains on the CPU (torch.cuda.is_available() is "
                       "False); with one process the backend carries nothing, so gloo is used instead. Pass "
                       "backend='gloo' (or None) to silence this")
    assert dist.get_backend() == "gloo" and gpc.device == torch.device("cpu")
    assert train_one_step().device == torch.device("cpu")


def test_device_cpu_trains_on_the_cpu_where_cuda_is_available(cuda_is_there):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no backend given: gloo, silently
        launch_from_torch(config={}, device="cpu", verbose=False)
    assert dist.get_backend() == "gloo" and gpc.device == torch.device("cpu")
    engine = train_one_step()
    assert engine.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in engine.unwrapped_model.parameters())


def test_device_cpu_with_nccl_in_one_process_names_the_device_cpu(cuda_is_there):
    with pytest.warns(UserWarning, match=r"trains on the CPU \(launch\(device='cpu'\)\); with one process"):
        launch({}, rank=0, world_size=1, host=None, port=None, backend="nccl", verbose=False, device="cpu")
    assert dist.get_backend() == "gloo"


def test_nccl_for_several_processes_on_the_cpu_is_refused_before_any_group_starts(no_cuda):
    with pytest.raises(RuntimeError, match=r"^backend='nccl' needs GPUs, but the processes train on the CPU "
                                           r"\(torch.cuda.is_available\(\) is False\)\. Fix: backend='gloo'"):
        launch({}, rank=0, world_size=2, host="127.0.0.1", port=1, backend="nccl", verbose=False)


def test_more_processes_than_gpus_on_a_node_under_nccl_is_refused_with_the_fix(cuda_is_there, monkeypatch):
    """NCCL refuses two processes on one GPU, from inside the group's start, where the launch's message blamed the
    network (found by reading the CUDA-only paths). Refused before any GPU is chosen or group started."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"^2 processes on this node, 1 GPU\(s\): NCCL needs a GPU for each process "
                                           r"and refuses two on one\. Fix: start at most 1 per node \(torchrun "
                                           r"--nproc_per_node 1\), or backend='gloo'"):
        launch({}, rank=1, world_size=2, host="127.0.0.1", port=1, verbose=False)
    assert not dist.is_initialized()


def test_device_cuda_without_cuda_is_refused_with_the_fix(no_cuda):
    with pytest.raises(RuntimeError, match=r"launch\(device='cuda'\): torch.cuda.is_available\(\) is False .* "
                                           r"Fix: launch\(\.\.\., device='cpu'\)"):
        launch_from_torch(config={}, device="cuda", verbose=False)


@pytest.mark.parametrize("device", ["mps", "cuda:1", torch.device("cuda", 0)])
def test_other_devices_are_refused_naming_what_is_accepted(device):
    with pytest.raises(ValueError, match=r"expected 'cpu', 'cuda' or None .* set CUDA_VISIBLE_DEVICES"):
        launch_from_torch(config={}, device=device, verbose=False)
    assert gpc.config is None


def test_a_torch_device_cpu_is_accepted(cuda_is_there):
    launch_from_torch(config={}, device=torch.device("cpu"), verbose=False)
    assert gpc.device == torch.device("cpu")


def test_the_docs_no_accel_snippet_trains_on_the_cpu(tmp_path):
    (snippet,) = doc_python_blocks("docs/launch.md", "Training on the CPU")
    script = tmp_path / "no_accel.py"
    script.write_text(snippet + "\nfrom colossal_lite.core import global_context as gpc\n"
                                "import torch.distributed as dist\nprint('on', gpc.device, dist.get_backend())\n")
    assert "on cpu gloo" in run_python(script, ["--no-accel", "--set", "clip_grad_norm=1.0"]).stdout
