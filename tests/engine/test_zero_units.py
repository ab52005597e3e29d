"""Which modules ZeRO 2/3 makes FSDP2 units (``engine/fsdp_units.py``): the blocks a hand-written FSDP2 loop shards.

The policy only reads module structure, so these tests build models and need no process group; the units' effect
on collectives and numerics is checked on 2 ranks in ``test_zero_units_two_ranks.py``.
"""
import pytest
import torch
from torch import nn

from colossal_lite.engine.fsdp_units import block_units, statistics_norms


class Attention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)


class Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(d), Attention(d), nn.Sequential(nn.Linear(d, d), nn.GELU())


class NanoGPT(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.h = nn.ModuleList(Layer() for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(8), nn.Linear(8, 10)


def names(units):
    return [type(u).__name__ for u in units]


def test_repeated_blocks_of_a_module_list_are_the_units_not_their_inner_layers():
    model = NanoGPT()
    units = block_units(model)
    assert units == list(model.h)  # not the Attention or the MLP Sequential inside each Layer
    assert statistics_norms(model) == []  # LayerNorm stays in its block's unit


def test_blocks_in_several_sequentials_are_found_like_resnet_stages():
    class Basic(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2)

    stages = [nn.Sequential(Basic(), Basic()) for _ in range(3)]
    model = nn.Sequential(nn.Conv2d(2, 2, 1), *stages, nn.Flatten(), nn.Linear(2, 2))
    assert block_units(model) == [b for s in stages for b in s]
    assert statistics_norms(model) == [b.bn for s in stages for b in s]


def test_hugging_face_no_split_modules_name_the_blocks_through_a_users_wrapper():
    class Pretrained(NanoGPT):  # what PreTrainedModel subclasses declare: the classes never to split
        _no_split_modules = ["Layer"]

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.extra = Pretrained(), nn.Sequential(Layer(), nn.Linear(8, 8), Attention(), Attention())

    model = Wrapper()
    assert block_units(model) == list(model.lm.h) + [model.extra[0]]


def test_the_config_names_the_block_classes_outermost_first():
    model = NanoGPT()
    assert block_units(model, ["Attention"]) == [layer.attn for layer in model.h]
    assert block_units(model, ["Layer", "Attention"]) == list(model.h)  # attention inside a unit adds no unit


def test_a_class_the_model_does_not_have_is_named_in_the_error():
    with pytest.raises(ValueError, match=r"zero.shard_modules names \['Blok'\], which are not module classes of the "
                                         r"model; the model has: .*Layer"):
        block_units(NanoGPT(), ["Blok", "Layer"])


def test_without_repeated_blocks_each_layer_of_the_largest_sequential_is_a_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert block_units(model) == [model[0], model[2], model[4]]  # stage 3 still shards the parameters per layer


def test_batchnorm_without_affine_parameters_needs_no_unit():
    model = nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.BatchNorm1d(4), nn.GroupNorm(2, 4),
                          nn.InstanceNorm1d(4, affine=True))
    assert statistics_norms(model) == [model[1], model[3]]
    assert statistics_norms(torch.nn.BatchNorm1d(3)) == []  # the model itself is the root unit
