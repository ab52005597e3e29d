import pytest
import torch

from colossal_lite.core import global_context as gpc


@pytest.fixture
def deterministic_algorithms():
    """torch's deterministic kernels for the test (an exact resume compares bit for bit), and no process group
    left behind."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)
    gpc.destroy()
