import pytest
import torch
import torch.nn.functional as F

from colossal_lite.functional import mixup_batch, mixup_loss


def test_mixup_fixed_mixing_and_indices_match_formula():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    y = torch.tensor([0, 1, 2, 3])
    idx = torch.tensor([2, 0, 3, 1])
    mixed, y_perm, mixing = mixup_batch(x, y, mixing=0.3, indices=idx)
    expected = torch.stack([0.7 * x[i] + 0.3 * x[j] for i, j in enumerate([2, 0, 3, 1])])
    assert torch.allclose(mixed, expected)
    assert torch.equal(y_perm, torch.tensor([2, 0, 3, 1]))
    assert isinstance(mixing, float) and mixing == pytest.approx(0.3)


def test_mixup_same_seed_same_draw():
    x = torch.randn(8, 4)
    y = torch.arange(8)
    torch.manual_seed(123)
    a = mixup_batch(x, y, alpha=0.4)
    torch.manual_seed(123)
    b = mixup_batch(x, y, alpha=0.4)
    assert a[2] == b[2]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert isinstance(a[2], float) and 0.0 <= a[2] <= 1.0
    assert sorted(a[1].tolist()) == list(range(8))  # a permutation of the batch


def test_mixup_draws_vary_without_reseed():
    torch.manual_seed(0)
    x, y = torch.randn(4, 2), torch.arange(4)
    draws = {mixup_batch(x, y, alpha=1.0)[2] for _ in range(5)}
    assert len(draws) > 1


@pytest.mark.parametrize("alpha", [0, -0.5])
def test_mixup_rejects_non_positive_alpha(alpha):
    with pytest.raises(ValueError, match="alpha must be > 0"):
        mixup_batch(torch.zeros(2, 1), torch.zeros(2), alpha=alpha)


def test_mixup_rejects_bad_mixing_and_indices():
    with pytest.raises(ValueError, match=r"mixing must be in \[0, 1\]"):
        mixup_batch(torch.zeros(2, 1), torch.zeros(2), mixing=1.5)
    with pytest.raises(ValueError, match="indices must have shape"):
        mixup_batch(torch.zeros(2, 1), torch.zeros(2), indices=torch.tensor([0, 1, 0]))


def test_mixup_loss_matches_hand_formula():
    torch.manual_seed(1)
    out = torch.randn(4, 3)
    y = torch.tensor([0, 1, 2, 0])
    y_perm = torch.tensor([2, 0, 0, 1])
    expected = 0.75 * F.cross_entropy(out, y) + 0.25 * F.cross_entropy(out, y_perm)
    assert torch.allclose(mixup_loss(F.cross_entropy, out, y, y_perm, 0.25), expected)
