"""Config: attribute access, nesting, and loading a ``.py`` file in isolation."""
import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from colossal_lite.context import Config, ConfigException


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# -- Config as a dict with attribute access ---------------------------------------------------------
def test_attribute_and_item_access():
    cfg = Config(dict(BATCH_SIZE=32, fp16=dict(mode=None, growth=dict(factor=2.0))))
    assert cfg.BATCH_SIZE == cfg["BATCH_SIZE"] == 32
    assert isinstance(cfg.fp16, Config) and isinstance(cfg.fp16.growth, Config)
    assert cfg.fp16.growth.factor == 2.0
    cfg.NUM_EPOCHS = 3
    assert cfg["NUM_EPOCHS"] == 3
    cfg["zero"] = dict(stage=1)
    assert isinstance(cfg.zero, Config) and cfg.zero.stage == 1
    cfg.update(dict(extra=dict(a=1)))
    assert isinstance(cfg.extra, Config)
    del cfg.NUM_EPOCHS
    assert "NUM_EPOCHS" not in cfg


def test_dicts_inside_lists_stay_plain():
    cfg = Config(dict(gradient_handler=[dict(type="DataParallelGradientHandler")], pairs=(dict(a=1),)))
    assert type(cfg.gradient_handler[0]) is dict
    assert type(cfg.pairs[0]) is dict


def test_missing_attribute_is_attribute_error_and_hasattr_works():
    cfg = Config(dict(a=1))
    with pytest.raises(AttributeError, match="missing_key"):
        _ = cfg.missing_key
    with pytest.raises(KeyError):
        _ = cfg["missing_key"]
    assert hasattr(cfg, "a")
    assert not hasattr(cfg, "missing_key")
    assert getattr(cfg, "missing_key", "default") == "default"
    assert cfg.get("missing_key") is None
    with pytest.raises(AttributeError):
        del cfg.missing_key


def test_copy_is_a_plain_dict():
    cfg = Config(dict(mode="torch", init_scale=2.0))
    copied = cfg.copy()
    assert type(copied) is dict
    assert copied == {"mode": "torch", "init_scale": 2.0}
    copied.pop("mode")
    assert "mode" in cfg


def test_config_rejects_non_dicts():
    with pytest.raises(TypeError, match="dict"):
        Config([("a", 1)])
    with pytest.raises(TypeError, match="dict"):
        Config().update(3)


def test_config_pickles_and_keeps_nesting():
    cfg = pickle.loads(pickle.dumps(Config(dict(fp16=dict(mode=None), L=[dict(a=1)]))))
    assert isinstance(cfg, Config) and isinstance(cfg.fp16, Config) and type(cfg.L[0]) is dict


def test_user_keys_are_not_hidden_by_helper_attributes():
    cfg = Config(dict(source="imagenet", where="here"))
    assert cfg.source == "imagenet"
    assert cfg.where == "here"


# -- Config.from_file -----------------------------------------------------------------------------------
def test_from_file_keeps_public_values_and_functions(tmp_path):
    path = write(tmp_path / "my_config.py", """\
        import os
        import math as _m
        from collections import OrderedDict
        from colossal_lite.amp import AMP_TYPE

        BATCH_SIZE = 16
        fp16 = dict(mode=AMP_TYPE.TORCH)
        handlers = [dict(type="DataParallelGradientHandler")]
        _private = 1

        class Helper:
            pass

        def lr_at(step):
            return 0.1 / (step + 1)

        scale = lambda x: 2 * x
        """)
    cfg = Config.from_file(path)
    assert set(cfg) == {"BATCH_SIZE", "fp16", "handlers", "lr_at", "scale"}
    assert cfg.lr_at(1) == pytest.approx(0.05) and cfg.scale(2) == 4
    assert isinstance(cfg.fp16, Config) and type(cfg.handlers[0]) is dict
    from colossal_lite.amp import AMP_TYPE

    assert cfg.fp16.mode is AMP_TYPE.TORCH  # the same enum the package uses, not a re-imported copy


def test_from_file_accepts_str_and_path(tmp_path):
    path = write(tmp_path / "c.py", "A = 1\n")
    assert Config.from_file(str(path)) == Config.from_file(path) == {"A": 1}


def test_from_file_leaves_sys_modules_and_sys_path_alone(tmp_path):
    path = write(tmp_path / "isolated_config_xyz.py", "BATCH_SIZE = 8\n")
    path_before = list(sys.path)
    modules_before = set(sys.modules)
    Config.from_file(path)
    assert sys.path == path_before
    new = set(sys.modules) - modules_before
    assert not any("isolated_config_xyz" in name or name.startswith("_colossal_lite_config") for name in new), new
    assert str(tmp_path) not in sys.path


def test_config_imports_a_sibling_file_and_it_does_not_linger(tmp_path):
    write(tmp_path / "sibling_base_cfg.py", "BATCH_SIZE = 64\nNUM_EPOCHS = 3\n")
    path = write(tmp_path / "child.py", """\
        from sibling_base_cfg import *
        NUM_EPOCHS = 5
        """)
    path_before = list(sys.path)
    cfg = Config.from_file(path)
    assert cfg.BATCH_SIZE == 64 and cfg.NUM_EPOCHS == 5
    assert "sibling_base_cfg" not in sys.modules
    assert sys.path == path_before


def test_two_folders_with_same_sibling_names_do_not_mix(tmp_path):
    # a sibling module and a sibling package of the same names in two config folders
    for name, value in (("a", 1), ("b", 2)):
        write(tmp_path / name / "shared_base.py", f"VALUE = {value}\n")
        write(tmp_path / name / "shared_pkg" / "__init__.py", "")
        write(tmp_path / name / "shared_pkg" / "opts.py", f"OTHER = {value * 10}\n")
        write(tmp_path / name / "config.py", """\
            from shared_base import VALUE
            from shared_pkg.opts import OTHER
            """)
    first = Config.from_file(tmp_path / "a" / "config.py")
    second = Config.from_file(tmp_path / "b" / "config.py")
    assert (first.VALUE, first.OTHER) == (1, 10)
    assert (second.VALUE, second.OTHER) == (2, 20)
    assert not {"shared_base", "shared_pkg", "shared_pkg.opts"} & set(sys.modules)


def test_loading_twice_gives_equal_independent_configs(tmp_path):
    path = write(tmp_path / "c.py", "fp16 = dict(mode=None)\n")
    a, b = Config.from_file(path), Config.from_file(path)
    assert a == b
    a.fp16.mode = "torch"
    assert b.fp16.mode is None


# -- files that cannot be loaded --------------------------------------------------------------------------
def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "does_not_exist.py"
    with pytest.raises(ConfigException) as e:
        Config.from_file(path)
    assert str(path) in str(e.value) and "not found" in str(e.value)


def test_non_py_file_names_the_path_and_the_fix(tmp_path):
    path = write(tmp_path / "config.yaml", "fp16: torch\n")
    with pytest.raises(ConfigException) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert str(path) in msg and ".py" in msg and ".yaml" in msg


def test_folder_is_not_a_config(tmp_path):
    with pytest.raises(ConfigException, match="folder"):
        Config.from_file(tmp_path)


def test_wrong_path_type():
    with pytest.raises(TypeError, match="str or pathlib.Path"):
        Config.from_file(42)


def test_syntax_error_names_file_and_line_without_importlib_traceback(tmp_path):
    path = write(tmp_path / "broken.py", """\
        BATCH_SIZE = 4
        fp16 = dict(
            mode=None,
        clip_grad_norm = 1.0
        """)
    with pytest.raises(ConfigException) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:")
    assert "syntax error" in msg
    line = int(msg[len(str(path)) + 1:].split(":")[0])
    assert line in (2, 3, 4)  # where Python reports the unclosed parenthesis
    assert e.value.__cause__ is None and "importlib" not in msg


def test_error_raised_by_the_config_names_its_line(tmp_path):
    path = write(tmp_path / "raises.py", """\
        BATCH_SIZE = 4

        NUM_EPOCHS = 1 / 0
        """)
    with pytest.raises(ConfigException) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert f"{path}:3" in msg and "ZeroDivisionError" in msg


def test_failed_sibling_import_names_the_config_line_and_cleans_up(tmp_path):
    path = write(tmp_path / "imports_missing.py", "A = 1\nfrom no_such_sibling_module_q import B\n")
    path_before = list(sys.path)
    with pytest.raises(ConfigException) as e:
        Config.from_file(path)
    assert f"{path}:2" in str(e.value) and "no_such_sibling_module_q" in str(e.value)
    assert sys.path == path_before


@pytest.mark.parametrize("line", ["from colossalai.amp import AMP_TYPE", "import colossalai"])
def test_a_legacy_import_of_colossalai_names_the_fix(tmp_path, line):
    """A legacy Colossal-AI config fails at its first line, and the bare ModuleNotFoundError said nothing more."""
    path = write(tmp_path / "legacy.py", f"{line}\nfp16 = dict(mode='naive')\n")
    with pytest.raises(ConfigException) as e:
        Config.from_file(path)
    assert str(e.value) == (f"{path}:1: error while executing config: ModuleNotFoundError: No module named "
                            f"'colossalai'. Fix: replace 'colossalai' with 'colossal_lite' in the config's imports")
    write(path, f"{line.replace('colossalai', 'colossal_lite')}\nfp16 = dict(mode='naive')\n")
    assert Config.from_file(path).fp16.mode == "naive"
