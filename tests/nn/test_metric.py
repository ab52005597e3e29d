import torch

from colossal_lite.nn.metric import Accuracy, calc_acc


def test_accuracy_counts_correct_argmax():
    logits = torch.tensor([[0.1, 0.9, 0.0], [2.0, 1.0, 0.0], [0.0, 0.2, 0.3], [1.0, 3.0, 2.0]])
    targets = torch.tensor([1, 0, 1, 2])
    expected = sum(int(row.argmax()) == int(t) for row, t in zip(logits, targets))
    result = Accuracy()(logits, targets)
    assert isinstance(result, torch.Tensor)
    assert result.dim() == 0
    assert result.device == logits.device
    assert int(result) == expected == 2


def test_accuracy_accepts_list_and_tuple():
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    other = torch.zeros(2, 2)
    targets = torch.tensor([1, 1])
    assert int(calc_acc([logits, other], targets)) == 1
    assert int(Accuracy()((logits, other), targets)) == 1


def test_accuracy_sequence_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    assert int(calc_acc(logits, targets)) == int((logits.argmax(-1) == targets).sum())
