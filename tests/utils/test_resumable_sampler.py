"""Resuming the data order mid-epoch: same remaining batches, skipped samples never loaded."""
import pytest
import torch
from torch.utils.data import Dataset

from colossal_lite.engine.accumulation import AccumulationDataLoader, AccumulationWindow
from colossal_lite.utils.data import (
    DataParallelSampler,
    ResumableDataLoader,
    batches_per_epoch,
    get_dataloader,
    skip_batches,
)


class Counting(Dataset):
    """Records which samples were loaded."""

    def __init__(self, n):
        self.n = n
        self.loaded = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor(i)


def _epochs(loader, n):
    return [[b.tolist() for b in loader] for _ in range(n)]


def test_world_size_one_uses_our_sampler_and_reshuffles_every_epoch():
    loader = get_dataloader(Counting(10), shuffle=True, seed=3, batch_size=4)
    assert isinstance(loader, ResumableDataLoader)
    assert isinstance(loader.sampler, DataParallelSampler) and loader.sampler.num_replicas == 1
    epochs = _epochs(loader, 3)
    assert epochs == _epochs(get_dataloader(Counting(10), shuffle=True, seed=3, batch_size=4), 3)  # from seed
    assert epochs[0] != epochs[1] != epochs[2]
    assert all(sorted(sum(e, [])) == list(range(10)) for e in epochs)
    assert _epochs(get_dataloader(Counting(5), batch_size=2), 2) == [[[0, 1], [2, 3], [4]]] * 2


@pytest.mark.parametrize("drop_last", [False, True])
def test_resuming_at_every_batch_gives_the_uninterrupted_order_and_loads_only_the_rest(drop_last):
    def make():
        return get_dataloader(Counting(11), shuffle=True, seed=7, batch_size=3, drop_last=drop_last)

    reference = _epochs(make(), 4)
    per_epoch = len(reference[0])
    for epoch in range(2):
        for b in range(per_epoch + 1):
            loader = make()
            _epochs(loader, epoch)
            it = iter(loader)
            for _ in range(b):
                next(it)
            state = loader.state_dict()
            assert state["sampler"] == ({"epoch": epoch, "offset": 3 * b} if b < per_epoch
                                        else {"epoch": epoch + 1, "offset": 0})

            resumed = make()
            resumed.load_state_dict(state)
            rest = [x.tolist() for x in resumed]
            loaded = resumed.dataset.loaded
            if b < per_epoch:
                assert rest == reference[epoch][b:]
                assert sorted(loaded) == sorted(sum(rest, []))  # nothing skipped was loaded
            else:
                assert rest == reference[epoch + 1]
            assert [x.tolist() for x in resumed] == reference[epoch + 1 if b < per_epoch else epoch + 2]


def test_len_is_what_the_resumed_iteration_yields_and_the_window_sees_it():
    loader = get_dataloader(Counting(10), batch_size=2)
    skip_batches(loader, 3)
    assert len(loader) == 2 and loader.sampler.num_samples == 10 and batches_per_epoch(loader) == 5
    window = AccumulationWindow(4)
    wrapped = AccumulationDataLoader(loader, window)
    assert len(wrapped) == 2
    assert [b.tolist() for b in wrapped] == [[6, 7], [8, 9]]
    assert len(loader) == 5 and [b.tolist() for b in loader][0] == [0, 1]


def test_counts_batches_handed_out_not_those_prefetched_by_workers():
    loader = get_dataloader(Counting(40), shuffle=True, batch_size=2, num_workers=2, prefetch_factor=4)
    reference = [b.tolist() for b in get_dataloader(Counting(40), shuffle=True, batch_size=2)]
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    assert got == reference[:3]
    state = loader.state_dict()
    assert state["sampler"] == {"epoch": 0, "offset": 6}  # the workers fetched up to 16 batches ahead
    del it
    resumed = get_dataloader(Counting(40), shuffle=True, batch_size=2)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == reference[3:]


def test_ranks_resume_their_own_share():
    data = Counting(10)
    samplers = [DataParallelSampler(data, shuffle=True, seed=1, num_replicas=2, rank=r) for r in range(2)]
    full = [list(s) for s in samplers]
    assert sorted(full[0] + full[1]) == list(range(10))
    for r, s in enumerate(samplers):
        fresh = DataParallelSampler(data, shuffle=True, seed=1, num_replicas=2, rank=r)
        fresh.load_state_dict({"epoch": 0, "offset": 2})
        assert list(fresh) == full[r][2:]
        assert list(fresh) == list(s)  # both moved on to epoch 1


def test_sampler_state_between_epochs_and_with_set_epoch():
    s = DataParallelSampler(Counting(6), shuffle=True, seed=0, num_replicas=1, rank=0)
    assert s.state_dict() == {"epoch": 0, "offset": 0}
    list(s)
    assert s.state_dict() == {"epoch": 1, "offset": 0}  # the next iteration auto-advances
    s.set_epoch(5)
    assert s.state_dict() == {"epoch": 5, "offset": 0}
    s.load_state_dict({"epoch": 2, "offset": 4})
    s.set_epoch(2)  # the same epoch (a loop that calls set_epoch every epoch): the offset stays
    assert len(list(s)) == 2
    s.load_state_dict({"epoch": 2, "offset": 4})
    s.set_epoch(3)  # another epoch: it starts at 0
    assert list(s) == s.indices(3)
    s.load_state_dict({"epoch": 2, "offset": 6})  # an epoch fully consumed is the next one at 0
    assert s.state_dict() == {"epoch": 3, "offset": 0} and list(s) == s.indices(3)


def test_bad_states_and_loaders_are_explained():
    s = DataParallelSampler(Counting(6), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"a DataParallelSampler state is \{'epoch': int, 'offset': int\}"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="offset >= 0"):
        s.load_state_dict({"epoch": 1, "offset": -2})
    with pytest.raises(TypeError, match="skip_batches needs a loader whose sampler is a DataParallelSampler"):
        skip_batches(torch.utils.data.DataLoader(Counting(4)), 1)


def test_resume_cost_does_not_grow_with_the_position():
    n = 20_000
    loader = get_dataloader(Counting(n), shuffle=True, batch_size=100)
    loader.load_state_dict({"sampler": {"epoch": 0, "offset": n - 100}})
    assert [len(b) for b in loader] == [100]
    assert len(loader.dataset.loaded) == 100  # 19,900 samples skipped without being loaded
