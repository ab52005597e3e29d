"""Plain-value conversion, atomic single-file writes, safe loading and RNG capture."""
import collections
import enum
import os
import pickle
import random

import pytest
import torch

from colossal_lite.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    UnsafeCheckpointError,
    UnsupportedValueError,
    atomic_save,
    capture_rng_state,
    load_file,
    restore_rng_state,
    to_plain,
)
from colossal_lite.context.config import Config


class Color(enum.Enum):
    RED = "red"


class Marker:
    """Unpickling this creates the marker file: proof that code from the file ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_to_plain_converts_known_types_and_keeps_plain_containers():
    np = pytest.importorskip("numpy")
    Point = collections.namedtuple("Point", "x y")
    state = {"config": Config({"amp": {"mode": Color.RED}, "lr": 0.1}), "point": Point(1, 2),
             "arr": np.arange(3, dtype=np.uint32), "scalar": np.float32(1.5), "frozen": frozenset({1})}
    plain = to_plain(state)
    assert type(plain["config"]) is dict and type(plain["config"]["amp"]) is dict
    assert plain["config"]["amp"]["mode"] == "red"
    assert type(plain["point"]) is tuple and plain["point"] == (1, 2)
    assert torch.equal(plain["arr"], torch.tensor([0, 1, 2]))
    assert plain["scalar"] == 1.5 and type(plain["scalar"]) is float
    assert plain["frozen"] == {1} and type(plain["frozen"]) is set
    sd = torch.nn.Linear(2, 2).state_dict()
    assert to_plain(sd) is sd  # nothing to convert: the model state (and its metadata) is kept as is


def test_to_plain_names_where_an_unstorable_value_sits():
    with pytest.raises(UnsupportedValueError) as e:
        to_plain({"trainer": {"hooks": [1, object()]}}, "shared_state")
    msg = str(e.value)
    assert "shared_state['trainer']['hooks'][1]" in msg
    assert "builtins.object is not a tensor or a plain Python value" in msg
    with pytest.raises(UnsupportedValueError, match="callable"):
        to_plain({"fn": lambda x: x})


def test_atomic_save_round_trip_leaves_no_temp_files(tmp_path):
    path = tmp_path / "ck.pt"
    atomic_save({"w": torch.arange(4.0), "epoch": 3, "mode": Color.RED}, path)
    atomic_save({"w": torch.arange(5.0), "epoch": 4, "mode": Color.RED}, path)
    loaded = load_file(path)
    assert loaded["epoch"] == 4 and loaded["mode"] == "red" and torch.equal(loaded["w"], torch.arange(5.0))
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]


def test_atomic_save_failure_names_the_path_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "ck.pt"
    atomic_save({"epoch": 1}, path)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointWriteError) as e:
        atomic_save({"epoch": 2}, blocker / "ck.pt")
    assert str(blocker / "ck.pt") in str(e.value) and "Not a directory" in str(e.value)
    (tmp_path / "dir.pt").mkdir()  # the rename itself fails: the target is a folder
    with pytest.raises(CheckpointWriteError, match="dir.pt"):
        atomic_save({"epoch": 2}, tmp_path / "dir.pt")
    assert load_file(path) == {"epoch": 1}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


@pytest.mark.parametrize("fmt", ["torch_zip", "raw_pickle"])
def test_a_file_with_pickled_objects_is_refused_and_nothing_runs(tmp_path, fmt):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    payload = {"model": {"w": torch.zeros(2)}, "x": Marker(marker)}
    if fmt == "torch_zip":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError) as e:
        load_file(path)
    msg = str(e.value)
    assert str(path) in msg and "objects other than tensors and plain Python values" in msg
    assert "Nothing in it was run" in msg
    assert not marker.exists()
    # the payload is live: an unsafe load would have run it (so the test above can fail)
    if fmt == "torch_zip":
        torch.load(path, weights_only=False)
    else:
        with open(path, "rb") as f:
            pickle.load(f)
    assert marker.exists()


def test_truncated_and_missing_files_have_clear_errors(tmp_path):
    path = tmp_path / "ck.pt"
    atomic_save({"w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or damaged") as e:
        load_file(path)
    assert str(path) in str(e.value)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_file(tmp_path / "nope.pt")


def _draws():
    out = [random.random(), random.gauss(0, 1), torch.rand(3).tolist()]
    try:
        import numpy as np
    except ImportError:
        return out
    return out + [np.random.rand(3).tolist(), np.random.normal()]


def test_rng_state_round_trips_through_a_safe_file(tmp_path):
    random.seed(1)
    torch.manual_seed(1)
    random.gauss(0, 1)  # leave a cached gaussian in Python's state
    state = capture_rng_state()
    expected = _draws()
    atomic_save(state, tmp_path / "rng.pt")  # only plain values: a weights_only load must accept it
    loaded = load_file(tmp_path / "rng.pt")
    _draws()
    restore_rng_state(loaded)
    assert _draws() == expected
    assert isinstance(loaded["torch"], torch.Tensor) and loaded["torch"].dtype == torch.uint8
    assert isinstance(loaded["python"]["state"], list)


class TwoGpus:
    """torch.cuda's generator calls on a machine with two GPUs (there is none here): a state per device index."""

    def __init__(self, monkeypatch, current: int):
        self.states = {0: torch.full((8,), 10, dtype=torch.uint8), 1: torch.full((8,), 11, dtype=torch.uint8)}
        self.current = current
        for name, fn in dict(is_available=lambda: True, device_count=lambda: 2, current_device=lambda: self.current,
                             get_rng_state_all=lambda: [self.states[0], self.states[1]],
                             get_rng_state=lambda device: self.states[device],
                             set_rng_state=self._set).items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def _set(self, state, device):
        self.states[device] = state.clone()


def test_a_resume_on_another_gpu_index_gives_the_rank_its_own_generator(monkeypatch):
    """Saved by a rank on cuda:1, resumed where that rank runs on cuda:0 (another CUDA_VISIBLE_DEVICES or number
    of processes per node): its device draws on from the generator the rank drew from, not device 0's (found by
    reading the CUDA-only paths; the generators are faked, the only part that cannot run here)."""
    gpus = TwoGpus(monkeypatch, current=1)
    state = capture_rng_state()
    gpus.current = 0
    gpus.states = {0: torch.zeros(8, dtype=torch.uint8), 1: torch.zeros(8, dtype=torch.uint8)}
    restore_rng_state(state)
    assert gpus.states[0].tolist() == [11] * 8  # the saving rank's own (cuda:1's) state


@pytest.mark.gpu
def test_rng_restore_warns_about_generators_it_cannot_restore():
    state = capture_rng_state()
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="random state of 2 CUDA device.*CUDA is not available"):
            restore_rng_state({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2})
    else:
        n = torch.cuda.device_count()
        with pytest.warns(UserWarning, match=f"{n + 1} CUDA device.*sees {n}"):
            restore_rng_state({**state, "cuda": state["cuda"] + [state["cuda"][0]]})
