"""The type of each option inside a feature dict (``torch_ddp``, ``zero``, ``gradient_handler``, ``compile``).

Checked at launch like the top-level keys, because the code that takes the options later says less: DDP's
constructor is a pybind function whose ``TypeError`` names neither the key nor the fix, and a string such as
``'false'`` where a flag is needed is truthy, so it switches on what it names without a word. Each function
takes the validator's checker, whose ``fail`` raises the error (file:line, key, problem, fix).
"""
from __future__ import annotations

import inspect
import numbers
from typing import Any, Dict, Optional

from .config import ConfigException
from .hints import as_bool, as_number, as_positive_int, as_positive_number

# DDP options that are flags whatever their default (``broadcast_buffers`` defaults to None in recent torch);
# any other option whose default is a bool is a flag too, so options of later torch versions are covered.
DDP_FLAGS = ("broadcast_buffers", "init_sync", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view",
             "static_graph", "skip_all_reduce_unused_params", "batched_grad_copy", "forward_sync_buffers")
COMPILE_FLAGS = ("fullgraph", "dynamic")


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def ddp_defaults() -> Dict[str, Any]:
    """DistributedDataParallel's keyword arguments (those a config may give) and their defaults."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {k: p.default for k, p in params.items() if k not in ("self", "module")}


def check_ddp_option(checker, name: str, value, default) -> None:
    """One ``torch_ddp`` option: flags True/False, ``dim`` an int, bucket sizes positive numbers (MiB)."""
    path = ("torch_ddp", name)
    if name in DDP_FLAGS or isinstance(default, bool):
        checker.flag(path, value, none_ok=default is None)
    elif name == "dim" and not _is_int(value):
        number = as_number(value)
        meant = int(number) if number is not None and number == int(number) else None
        checker.fail(path, f"expected an int (the batch dimension), got {value!r}", checker.write(path, meant, 0))
    elif name == "bucket_cap_mb" and value is not None and (not _is_number(value) or value <= 0):
        checker.fail(path, f"expected a number of MiB > 0 (or None), got {value!r}",
                     checker.write(path, as_positive_number(value), 25))
    elif name == "bucket_cap_mb_list" and value is not None and not (
            isinstance(value, (list, tuple)) and all(_is_number(v) and v > 0 for v in value)):
        checker.fail(path, f"expected a list of MiB > 0 (or None), got {value!r}", checker.write(path, None, [1, 25]))


def check_zero_options(checker, zero: dict) -> None:
    """``offload_optimizer`` a flag, ``shard_modules`` a list of module class names, ``reshard_after_forward``
    None, a flag or a positive int (FSDP2 reshards to groups of that many ranks)."""
    if "offload_optimizer" in zero:
        checker.flag(("zero", "offload_optimizer"), zero["offload_optimizer"])
    modules = zero.get("shard_modules")
    if modules is not None and not (isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules)):
        meant = _class_names(modules)
        checker.fail(("zero", "shard_modules"), f"expected a list of module class names, got {modules!r}",
                     checker.write(("zero", "shard_modules"), meant, ["Block"]))
    reshard = zero.get("reshard_after_forward")
    if reshard is not None and not isinstance(reshard, bool) and not (_is_int(reshard) and reshard >= 1):
        path = ("zero", "reshard_after_forward")
        meant = as_bool(reshard)
        checker.fail(path, f"expected True, False, None or a positive int, got {reshard!r}",
                     checker.write(path, as_positive_int(reshard) if meant is None else meant, True))


def check_zero_world_size(config, world_size: int) -> None:
    """An int ``reshard_after_forward`` is the size of the rank groups FSDP2 reshards to after each forward, so it
    must divide the world size, which only the launch knows; refused there, before any process group starts,
    rather than by FSDP2's bare ``ValueError`` inside ``initialize``."""
    zero = config.get("zero") or {}
    reshard = zero.get("reshard_after_forward")
    if not _is_int(reshard) or zero.get("stage") not in (2, 3) or world_size % reshard == 0:
        return
    factors = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
    raise ConfigException(
        f"{config._where('zero', 'reshard_after_forward')}: config key 'zero.reshard_after_forward': {reshard} is not a "
        f"factor of the world size {world_size} (FSDP2 reshards each unit's parameters to groups of that many ranks "
        f"after its forward). Fix: use a factor of {world_size} ({factors}), True (reshard to all ranks) or False")


def _class_names(modules) -> Optional[list]:
    """``['Block']`` meant by ``'Block'``, ``Block`` or ``[Block, 'Head']`` (classes named by their name)."""
    items = modules if isinstance(modules, (list, tuple)) else [modules]
    names = [m if isinstance(m, str) else m.__name__ if isinstance(m, type) else None for m in items]
    return None if any(n is None for n in names) else names


def check_handler_options(checker, index: int, entry: dict, constructor) -> None:
    """The options of ``gradient_handler[index]``: the built-in handler's bucket size is MiB > 0; an option of
    the user's handler whose default is a bool must be a bool (a string would be truthy)."""
    defaults = {"bucket_size_mb": 25.0} if constructor is None else {
        k: p.default for k, p in inspect.signature(constructor).parameters.items()}
    for name, value in entry.items():
        # a list entry cannot be set with --set, so the fix is always a config line
        fix_key, key = ("gradient_handler", name), f"gradient_handler[{index}].{name}"
        if constructor is None and name == "bucket_size_mb" and (not _is_number(value) or value <= 0):
            checker.fail(("gradient_handler",), f"expected a number of MiB > 0, got {value!r}",
                         checker.write(fix_key, as_positive_number(value), 25.0, cli=False), key=key)
        if isinstance(defaults.get(name), bool) and not isinstance(value, bool):
            checker.fail(("gradient_handler",), f"expected True or False, got {value!r}",
                         checker.write(fix_key, as_bool(value), not defaults[name], cli=False), key=key)


def check_compile_option(checker, name: str, value) -> None:
    """``fullgraph`` a flag, ``dynamic`` a flag or None, ``options`` a dict, ``mode`` a string (or None),
    ``backend`` a name or a callable."""
    path = ("compile", name)
    if name in COMPILE_FLAGS:
        checker.flag(path, value, none_ok=name == "dynamic")
    elif name == "options" and value is not None and not isinstance(value, dict):
        checker.fail(path, f"expected a dict of inductor options, got {type(value).__name__}",
                     checker.write(path, None, {"triton.cudagraphs": False}))
    elif name == "mode" and value is not None and not isinstance(value, str):
        checker.fail(path, f"expected a mode name, got {value!r}", checker.write(path, None, "max-autotune"))
    elif name == "backend" and not (isinstance(value, str) or callable(value)):
        checker.fail(path, f"expected a backend name or a callable (torch.compile's backend), got {value!r}",
                     checker.write(path, None, "inductor"))
