"""colossal_lite.nn.CheckpointModule: the legacy base module the engine and trainer tests build models on."""
import copy
import textwrap

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn

from colossal_lite.nn import CheckpointModule


class SimpleNet(CheckpointModule):
    """As the legacy tests write their models: layers in __init__, the computation in _forward."""

    def __init__(self, checkpoint=False, offload=False):
        super().__init__(checkpoint=checkpoint, offload=offload)
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 4)
        self.proj1 = nn.Linear(4, 8)
        self.ln1 = nn.LayerNorm(8)
        self.proj2 = nn.Linear(8, 4)
        self.ln2 = nn.LayerNorm(4)
        self.calls = 0

    def _forward(self, x, scale=1.0):
        self.calls += 1
        x = self.embed(x)
        x = torch.tanh(self.ln1(self.proj1(x)))
        return self.ln2(self.proj2(x)) * scale


def tokens():
    return torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))


def saved_tensor_count(model, *args, **kwargs):
    """How many tensors autograd keeps for backward from this forward (outside any checkpoint)."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
    return out, count[0]


@pytest.mark.parametrize("offload", [False, True])
def test_same_outputs_and_gradients_as_without_checkpointing(offload):
    plain, ckpt = SimpleNet(checkpoint=False), SimpleNet(checkpoint=True, offload=offload)
    x = tokens()
    outs = []
    for model in (plain, ckpt):
        out = model(x, scale=2.0)
        out.square().mean().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # the checkpointed forward ran again in backward: the activations were recomputed, not kept
    assert (plain.calls, ckpt.calls) == (1, 2)


def test_activations_are_not_kept():
    x = tokens()
    _, kept_plain = saved_tensor_count(SimpleNet(checkpoint=False), x)
    out, kept_ckpt = saved_tensor_count(SimpleNet(checkpoint=True), x)
    assert kept_plain >= 8  # the embedding's indices, each linear's input, the norms' statistics, tanh's output
    assert kept_ckpt == 1  # the input alone (the checkpoint saves it to recompute from)
    out.sum().backward()  # and backward still works


def test_eval_mode_and_no_grad_call_forward_directly():
    model = SimpleNet(checkpoint=True).eval()
    _, kept = saved_tensor_count(model, tokens())
    assert kept >= 8 and model.calls == 1  # no checkpoint: activations kept, no recomputation
    model.train()
    with torch.no_grad():
        model(tokens())
    assert model.calls == 2  # nothing to recompute under no_grad: one call
    # train()/eval() of a parent reach it (legacy's own train(False) override turned checkpointing back on)
    parent = nn.Sequential(model)
    parent.eval()
    _, kept = saved_tensor_count(parent, tokens())
    assert kept >= 8


def test_offload_without_checkpoint_gives_the_same_outputs_and_gradients():
    plain, offloaded = SimpleNet(checkpoint=False), SimpleNet(checkpoint=False, offload=True)
    outs = []
    for model in (plain, offloaded):
        outs.append(model(tokens()))
        outs[-1].sum().backward()
    assert torch.equal(outs[0], outs[1])
    for p, q in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(p.grad, q.grad)


class Block(CheckpointModule):
    def __init__(self, checkpoint, offload):
        super().__init__(checkpoint=checkpoint, offload=offload)
        self.fc = nn.Linear(4096, 4096)

    def _forward(self, h):
        return torch.relu(self.fc(torch.relu(self.fc(h))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves tensors from an accelerator to the host")
@pytest.mark.parametrize("checkpoint", [False, True])
def test_offload_keeps_what_backward_needs_off_the_gpu(checkpoint):
    """After forward, the GPU holds one activation less per offloaded tensor; gradients are unchanged."""
    kept, grads = {}, {}
    for offload in (False, True):
        torch.manual_seed(0)
        pre, block = nn.Linear(64, 4096).cuda(), Block(checkpoint, offload).cuda()
        x = torch.randn(1024, 64, device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = block(pre(x))  # pre's output is held only by what the block keeps for backward
        torch.cuda.synchronize()
        kept[offload] = torch.cuda.memory_allocated() - before
        out.square().mean().backward()
        grads[offload] = [p.grad.cpu() for p in (*pre.parameters(), *block.parameters())]
    activation = 1024 * 4096 * 4
    assert kept[False] - kept[True] >= activation, kept
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b)


class DropoutBlock(CheckpointModule):
    def __init__(self, offload):
        super().__init__(checkpoint=True, offload=offload)
        self.fc, self.drop = nn.Linear(256, 256), nn.Dropout(0.5)

    def _forward(self, h):
        return self.fc(self.drop(torch.relu(self.fc(h))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the accelerator's random state is what is checked")
def test_offloaded_checkpointing_recomputes_with_the_forwards_dropout_mask():
    """With the inputs held on the CPU, torch saw no accelerator among the checkpoint's inputs and did not save its
    random state: the recomputation drew another dropout mask, and the gradients were silently wrong (found by
    reading the CUDA-only paths). Offloaded and kept on the device, the gradients are the same bit for bit."""
    grads = {}
    for offload in (False, True):
        torch.manual_seed(0)
        block = DropoutBlock(offload).cuda()
        x = torch.randn(64, 256, device="cuda", requires_grad=True)
        torch.cuda.manual_seed(1)
        block(x).square().mean().backward()
        grads[offload] = [x.grad.cpu()] + [p.grad.cpu() for p in block.parameters()]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_a_subclass_without_forward_says_what_to_write():
    with pytest.raises(NotImplementedError, match="implement _forward"):
        CheckpointModule(checkpoint=False)(torch.zeros(1))


def test_trains_through_initialize_like_the_legacy_engine_tests(tmp_path):
    """The legacy engine test flow (initialize, the engine loop) with a checkpointed model equals the plain one."""
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    results = []
    for checkpoint in (False, True):
        gpc.destroy()
        colossal_lite.launch_from_torch(config={}, seed=1, verbose=False)
        model = SimpleNet(checkpoint=checkpoint)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        data = [(tokens(), torch.randn(3, 5, 4)) for _ in range(4)]
        engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.MSELoss(), data, verbose=False)
        engine.train()
        for x, y in loader:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
        results.append(copy.deepcopy(model.state_dict()))
        gpc.destroy()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


TWO_RANKS = textwrap.dedent("""
    import torch
    from torch import nn
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.nn import CheckpointModule

    class Net(CheckpointModule):
        def __init__(self, checkpoint):
            super().__init__(checkpoint=checkpoint)
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)
            self.calls = 0
        def _forward(self, x):
            self.calls += 1
            return self.b(torch.relu(self.a(x)))

    colossal_lite.launch_from_torch(config={}, seed=3, verbose=False)
    g = torch.Generator().manual_seed(10 + gpc.get_global_rank())
    data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    params = []
    for checkpoint in (False, True):
        model = Net(checkpoint)
        engine, _, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   nn.CrossEntropyLoss(), verbose=False)
        for x, y in data:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
        params.append([p.detach().clone() for p in model.parameters()])
        assert model.calls == (6 if checkpoint else 3), model.calls
    assert all(torch.equal(p, q) for p, q in zip(*params))
    # the ranks agree: data-parallel averaging ran through the checkpointed backward
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, [p.tolist() for p in params[1]])
    assert gathered[0] == gathered[1]
    print(f"OK {gpc.get_global_rank()}\\n", end="", flush=True)  # one write: the ranks' lines never mix
    gpc.destroy()
""")


def test_two_ranks_checkpointed_model_equals_plain_under_data_parallel(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    proc = run_ranks(script, nproc=2, timeout=180)
    assert proc.stdout.count("OK") == 2
