"""``colossal_lite.registry``: legacy's named registries, as the programs that use them call them."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optional_packages import require_torchvision

import colossal_lite.registry as registry
from colossal_lite.registry import GRADIENT_HANDLER, HOOKS, LAYERS, LOSSES, LR_SCHEDULERS, OPTIMIZERS, Registry

REPO = Path(__file__).resolve().parents[2]


def test_legacy_registries_exist():
    for name in ("LOSSES", "MODELS", "OPTIMIZERS", "DATASETS", "TRANSFORMS", "HOOKS", "LAYERS", "GRADIENT_HANDLER",
                 "DIST_GROUP_INITIALIZER", "MODEL_WRAPPERS", "LR_SCHEDULERS", "DATA_SAMPLERS", "SCHEDULE"):
        assert isinstance(getattr(registry, name), Registry), name
    assert GRADIENT_HANDLER.name == "gradient_handler"


def test_register_as_decorator_and_as_call():
    models = Registry("models_under_test")

    @models.register_module
    class Plain:
        pass

    @models.register_module()
    class Called:
        pass

    @models.register_module(name="renamed")
    class Named:
        pass

    def build_thing():
        return 3

    assert models.register_module(build_thing) is build_thing  # a plain call returns what it registered
    assert models.get_module("Plain") is Plain and models.get_module("Called") is Called
    assert models.get_module("renamed") is Named and models.get_module("build_thing")() == 3
    assert models.has("Plain") and "Called" in models and not models.has("Named")
    assert models.names() == ["Called", "Plain", "build_thing", "renamed"]


def test_a_taken_name_is_refused_unless_it_is_the_same_definition():
    reg = Registry("taken")

    @reg.register_module
    class Thing:
        pass

    first = Thing
    assert reg.register_module(first) is first  # the same class again: nothing to refuse

    def define_again():
        class Thing:  # another class of the same name, elsewhere
            pass
        return Thing

    other = define_again()
    with pytest.raises(KeyError, match="'Thing' is already taken by .*test_registry.*Thing"):
        reg.register_module(other)
    assert reg.get_module("Thing") is first
    reg.register_module(other, force=True)
    assert reg.get_module("Thing") is other

    class Reloaded:  # the same module and qualified name: a re-run script or reloaded module replaces it
        pass

    reg.register_module(Reloaded)
    Reloaded2 = type("Reloaded", (), {"__module__": Reloaded.__module__, "__qualname__": Reloaded.__qualname__})
    assert reg.register_module(Reloaded2) is Reloaded2 and reg.get_module("Reloaded") is Reloaded2


def test_missing_name_names_the_registry_its_names_and_the_nearest():
    reg = Registry("widgets")
    for name in ("Sprocket", "Gear"):
        reg.register_module(type(name, (), {}))
    with pytest.raises(NameError) as e:  # legacy raised NameError (or returned None without a library)
        reg.get_module("Sprocker")
    msg = str(e.value)
    assert "'Sprocker' is not registered in the registry 'widgets'" in msg
    assert "(registered: Gear, Sprocket)" in msg and "did you mean 'Sprocket'?" in msg
    with pytest.raises(NameError, match="not an attribute of torch.nn .*registered: none"):
        LOSSES.get_module("CrossEntropyLos")


def test_third_party_libraries_and_build():
    import colossal_lite.nn  # noqa: F401  (importing a package registers its classes, as in legacy)
    import colossal_lite.trainer  # noqa: F401

    assert LOSSES.get_module("CrossEntropyLoss") is torch.nn.CrossEntropyLoss
    assert LAYERS.get_module("Linear") is torch.nn.Linear and LAYERS.has("Conv2d")
    assert OPTIMIZERS.get_module("SGD") is torch.optim.SGD
    layer = LAYERS.build(dict(type="Linear", in_features=2, out_features=3), bias=False)
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None
    assert HOOKS.get_module("LossHook").__name__ == "LossHook"
    assert LR_SCHEDULERS.get_module("LinearWarmupLR").__name__ == "LinearWarmupLR"


def test_torchvision_is_imported_only_when_a_lookup_needs_it():
    require_torchvision("the lookup of resnet18 needs torchvision")
    probe = ("import sys; import colossal_lite, colossal_lite.registry as r; assert 'torchvision' not in sys.modules; "
             "m = r.MODELS.get_module('resnet18'); assert 'torchvision' in sys.modules; print(m.__name__)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "resnet18"


def test_the_legacy_optimizers_are_registered_by_name():
    import colossal_lite.nn  # noqa: F401  (registers them, as legacy's import did)
    from colossal_lite.nn.optimizer import Lamb, Lars
    from colossal_lite.registry import OPTIMIZERS

    assert OPTIMIZERS.get_module("Lamb") is Lamb and OPTIMIZERS.get_module("Lars") is Lars
