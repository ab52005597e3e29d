"""Checks a config completely before any process group starts.

Every error names the file and line (or ``<dict config>``), the key, what is wrong and the fix.
UPPERCASE names are the user's own hyper-parameters and are never checked.
"""
from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Union

import torch.distributed as dist

from ..amp.amp_type import AMP_TYPE
from ..logging import get_dist_logger
from ..registry import GRADIENT_HANDLER
from .config import Config, ConfigException
from .defaults import BF16_OPTIONS, DEFAULTS, NAIVE_AMP_OPTIONS, TORCH_AMP_OPTIONS, ZERO_OPTIONS
from .hints import amp_mode_meant, as_bool, as_choice, as_number, as_positive_int, as_positive_number, as_seconds, py
from .option_types import (
    check_compile_option,
    check_ddp_option,
    check_handler_options,
    check_zero_options,
    ddp_defaults,
)
from .overrides import OverriddenSource, apply_overrides, cli_spelling

# Older Colossal-AI examples write zero = dict(level=2, cpu_offload=True, verbose=False): today's name of each
# (None: the key has no effect and is dropped).
LEGACY_ZERO_KEYS = dict(level="stage", cpu_offload="offload_optimizer", verbose=None)
GRADIENT_HANDLERS = ("DataParallelGradientHandler",)  # built in; a user's own are found in the GRADIENT_HANDLER registry

# Common misspellings, mapped to the key that was meant.
ALIASES = {
    "gradient_clipping": "clip_grad_norm", "clip_grad": "clip_grad_norm", "grad_clip": "clip_grad_norm",
    "clip_grad_norm_": "clip_grad_norm", "max_grad_norm": "clip_grad_norm", "grad_norm_clip": "clip_grad_norm",
    "grad_accumulation": "gradient_accumulation", "gradient_accumulation_steps": "gradient_accumulation",
    "accumulate_grad_batches": "gradient_accumulation", "grad_accum": "gradient_accumulation",
    "fp_16": "fp16", "amp": "fp16", "mixed_precision": "fp16", "precision": "fp16",
    "ddp": "torch_ddp", "gradient_handlers": "gradient_handler", "cudnn_bench": "cudnn_benchmark",
}


def _is_bool(v):
    return isinstance(v, bool)

# Names other frameworks give their features (DeepSpeed, Lightning, Hugging Face, DDP's own keyword arguments), with
# colossal_lite's way to say the same. They stay the user's own values, as every other lowercase name does, but each
# gives a ForeignConfigKeyWarning: a user who wrote one most likely expected it to switch the feature on.
FOREIGN_KEYS = {
    "bf16": "fp16 = dict(mode=AMP_TYPE.BF16)", "use_fp16": "fp16 = dict(mode=AMP_TYPE.TORCH)",
    "fp16_mode": "fp16 = dict(mode=AMP_TYPE.TORCH)", "half": "fp16 = dict(mode=AMP_TYPE.TORCH)",
    "fp16_opt_level": "fp16 = dict(mode=AMP_TYPE.TORCH)",
    "zero_stage": "zero = dict(stage=2)", "zero_optimization": "zero = dict(stage=2)",
    "gradient_clip_val": "clip_grad_norm = 1.0", "max_norm": "clip_grad_norm = 1.0", "clip_norm": "clip_grad_norm = 1.0",
    "accum_steps": "gradient_accumulation = 4",
    "find_unused_parameters": "torch_ddp = dict(find_unused_parameters=True)",
    "bucket_cap_mb": "torch_ddp = dict(bucket_cap_mb=25)", "static_graph": "torch_ddp = dict(static_graph=True)",
    "gradient_as_bucket_view": "torch_ddp = dict(gradient_as_bucket_view=True)",
    "torch_compile": "compile = True",
}


_FP16_FLAGS = {"bf16": AMP_TYPE.BF16, "use_fp16": AMP_TYPE.TORCH, "half": AMP_TYPE.TORCH}
_CLIP_NAMES = ("gradient_clip_val", "max_norm", "clip_norm")
_DDP_FLAGS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")


def _zero_line(stage) -> Optional[str]:
    stage = 0 if stage == 0 and not isinstance(stage, bool) else as_positive_int(stage)
    if stage == 0:
        return "zero = None"  # stage 0 is no ZeRO: the key left out
    return f"zero = {py(dict(stage=stage))}" if stage in (1, 2, 3) else None


def _foreign_line(key: str, value) -> Optional[str]:
    """colossal_lite's config line for the foreign name ``key`` set to ``value``, carrying the value over; None when
    the value does not say what to write (the stock line of ``FOREIGN_KEYS`` is then an example)."""
    if key in _FP16_FLAGS or key == "fp16_mode":
        on = as_bool(value)
        if on is None and key == "fp16_mode":
            meant = amp_mode_meant(value)
            return None if meant is None else f"fp16 = {'None' if meant == 'None' else f'dict(mode={meant})'}"
        if on is None:
            return None
        return f"fp16 = {py(dict(mode=_FP16_FLAGS.get(key, AMP_TYPE.TORCH)))}" if on else "fp16 = None"
    if key == "fp16_opt_level":  # apex's levels: O0 is fp32, O1-O3 mixed precision
        level = str(value).strip().upper()
        if level == "O0":
            return "fp16 = None"
        return FOREIGN_KEYS[key] if level in ("O1", "O2", "O3") else None
    if key == "zero_stage":
        return _zero_line(value)
    if key == "zero_optimization":  # DeepSpeed's dict(stage=..., ...): the stage is what carries over
        return _zero_line(value.get("stage") if isinstance(value, dict) else value)
    if key in _CLIP_NAMES:
        norm = as_number(value)
        return None if norm is None or norm < 0 else f"clip_grad_norm = {py(norm)}"
    if key == "accum_steps":
        steps = as_positive_int(value)
        return None if steps is None else f"gradient_accumulation = {steps}"
    if key in _DDP_FLAGS:
        flag = as_bool(value)
        return None if flag is None else f"torch_ddp = {py({key: flag})}"
    if key == "bucket_cap_mb":
        size = as_positive_number(value)
        return None if size is None else f"torch_ddp = {py(dict(bucket_cap_mb=size))}"
    if key == "torch_compile":
        if isinstance(value, dict):
            return f"compile = {py(value)}"  # (torch.compile's options, which compile = dict(...) takes)
        flag = as_bool(value)
        return None if flag is None else f"compile = {flag}"
    return None


def foreign_key_fix(key: str, value) -> str:
    """What colossal_lite calls the foreign name ``key``'s setting: written with the user's own ``value`` wherever
    it carries over (``accum_steps = 3`` -> ``gradient_accumulation = 3``), else ``FOREIGN_KEYS``' example."""
    line = _foreign_line(key, value)
    return line if line is not None else f"e.g. {FOREIGN_KEYS[key]}"


class ForeignConfigKeyWarning(UserWarning):
    """A config name another framework reads as a feature setting, kept as the user's own value. A user whose own
    value it is silences it with ``warnings.filterwarnings('ignore', category=ForeignConfigKeyWarning)``."""


def _is_stage(v):
    """A ZeRO stage: the int 1, 2 or 3 (True and 2.0 compare equal to 1 and 2, and a stage read from them would
    not be the int the rest of the code compares with)."""
    return isinstance(v, int) and not isinstance(v, bool) and v in (1, 2, 3)


def _is_number(v):
    """A real, finite number: NaN passes every ``<``/``<=`` bound check (a NaN clip norm turned clipping off, a NaN
    loss scale skipped every update) and inf is no setting either."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


class _Checker:
    def __init__(self, config: Config):
        self.config = config

    def fail(self, path, problem: str, fix: str, key: Optional[str] = None):
        """Raise the error of the key at ``path`` (``key``: its name in the message, default the dotted path)."""
        key = key or ".".join(path)
        raise ConfigException(f"{self.config._where(*path)}: config key '{key}': {problem}. Fix: {fix}")

    def from_command_line(self, path) -> bool:
        """Whether a ``--set`` override set the key at ``path``: its fix is then written as an override."""
        source = self.config._source
        return isinstance(source, OverriddenSource) and source.override_of(tuple(path)) is not None

    def write(self, path, meant, stock, key=None, cli: Optional[bool] = None) -> str:
        """The fix for the key at ``path``: ``key`` (default ``path``) set to the value the user meant when it can be
        told, else to a stock example; spelled as ``--set`` when an override set the key (``cli``: decided by the
        caller), as a config line otherwise."""
        key = tuple(key or path)
        value, lead = (meant, "write") if meant is not None else (stock, "write e.g.")
        if self.from_command_line(path) if cli is None else cli:
            return f"{lead} " + " ".join(f"--set {k}={cli_spelling(v)}" for k, v in _dotted(key, value))
        return f"{lead} {key[-1]}{' = ' if len(key) == 1 else '='}{py(value)}"

    def flag(self, path, value, none_ok: bool = False) -> None:
        """The key at ``path`` is True or False (or None where ``none_ok``); a string like 'false' would be truthy."""
        if not (_is_bool(value) or none_ok and value is None):
            self.fail(path, f"expected True or False{' (or None)' if none_ok else ''}, got {value!r}",
                      self.write(path, as_bool(value), True))

    # -- per-key checks ---------------------------------------------------------------------
    def fp16(self, value):
        if value is None:
            return
        if not isinstance(value, dict):
            meant = None if isinstance(value, bool) else amp_mode_meant(value)
            fix = ("write fp16 = None (fp32) or remove the key" if value is False else
                   _cli_mode_fix(meant) if self.from_command_line(("fp16",)) else
                   f"write fp16 = dict(mode={meant or 'AMP_TYPE.TORCH'})" + ("" if meant else " (or BF16, NAIVE, None)"))
            self.fail(("fp16",), f"expected a dict like dict(mode=AMP_TYPE.TORCH), got {type(value).__name__}", fix)
        if "mode" not in value:
            mode = _mode_of_options(value)
            fix = (f"write fp16 = {py({'mode': mode, **value})}" if mode and value else
                   "add mode=AMP_TYPE.TORCH, AMP_TYPE.BF16, AMP_TYPE.NAIVE or None")
            self.fail(("fp16",), "missing 'mode'", fix)
        cli = self.from_command_line(("fp16", "mode"))
        mode = normalize_amp_mode(value["mode"], lambda problem, fix: self.fail(
            ("fp16", "mode"), problem, _cli_mode_fix(amp_mode_meant(value["mode"])) if cli else fix))
        if mode is AMP_TYPE.APEX:
            self.fail(("fp16", "mode"), "AMP_TYPE.APEX needs NVIDIA apex, which colossal_lite does not support",
                      "write --set fp16.mode=torch (torch autocast + GradScaler, the same O1 behaviour) or "
                      "--set fp16.mode=naive (O3-like)" if cli else _apex_fix(value.get("opt_level")))
        options = {None: {}, AMP_TYPE.TORCH: TORCH_AMP_OPTIONS, AMP_TYPE.NAIVE: NAIVE_AMP_OPTIONS,
                   AMP_TYPE.BF16: BF16_OPTIONS}[mode]
        if mode is AMP_TYPE.NAIVE and "clip_grad_norm" in value:
            value = self._legacy_naive_clipping(value)
        for opt, v in value.items():
            if opt == "mode":
                continue
            if opt not in options:
                self._unknown_amp_option(mode, opt, options)
            self._amp_option(opt, v, options)
        self._scale_factors(value, options)
        if mode is AMP_TYPE.NAIVE:
            self._scale_bounds(value)

    def _scale_factors(self, value: dict, options: dict):
        """A growth factor of 1 or less would shrink the scale after good steps (or never grow it), and a backoff
        factor of 1 or more would not back it off after an overflow: both modes' scalers multiply by them."""
        if "growth_factor" in value and value["growth_factor"] <= 1:
            v = value["growth_factor"]
            self.fail(("fp16", "growth_factor"), f"must be > 1 (the loss scale is multiplied by it after "
                      f"growth_interval good steps), got {v!r}",
                      self.write(("fp16", "growth_factor"), round(1 / v, 4) if 0 < v < 1 else None,
                                 options["growth_factor"]))
        if "backoff_factor" in value and not 0 < value["backoff_factor"] < 1:
            v = value["backoff_factor"]
            self.fail(("fp16", "backoff_factor"), "must be between 0 and 1 (the loss scale is multiplied by it)",
                      f"write backoff_factor={py(round(1 / v, 4)) if v > 1 else options['backoff_factor']}")

    def _scale_bounds(self, value: dict):
        """Naive fp16's scale starts at ``initial_scale`` and stays within ``[min_scale, max_scale]``; bounds that
        exclude it (legacy Colossal-AI's scaler asserted they did not) would clamp it at the first change."""
        low, high = value.get("min_scale"), value.get("max_scale")
        if low is not None and high is not None and low > high:
            self.fail(("fp16", "min_scale"), f"is {py(low)}, above max_scale={py(high)}",
                      f"swap them: write min_scale={py(high)}, max_scale={py(low)}")
        initial = value.get("initial_scale", NAIVE_AMP_OPTIONS["initial_scale"])
        for bound, name, outside in ((low, "min_scale", "below"), (high, "max_scale", "above")):
            if bound is None or (initial >= bound if name == "min_scale" else initial <= bound):
                continue
            if "initial_scale" in value:
                self.fail(("fp16", "initial_scale"), f"is {py(initial)}, {outside} {name}={py(bound)}",
                          f"write initial_scale={py(bound)} (or change {name})")
            self.fail(("fp16", name), f"is {py(bound)}, but initial_scale is {py(initial)} (its default), {outside} it",
                      f"add initial_scale={py(bound)} (or change {name})")

    def _legacy_naive_clipping(self, value: dict) -> dict:
        """Legacy naive fp16 took the clipping norm in its own dict (``FP16Optimizer(clip_grad_norm=...)``): it is
        read as the top-level ``clip_grad_norm``, in the config itself, with an info line that says so."""
        norm = value["clip_grad_norm"]
        if not _is_number(norm) or norm < 0:
            self.fail(("fp16", "clip_grad_norm"), f"expected a number >= 0 (the max global L2 norm; 0 turns clipping "
                      f"off), got {norm!r}", "write clip_grad_norm = 1.0 at the top level of the config and remove it here")
        top = self.config.get("clip_grad_norm")
        if top is not None and top != norm:
            self.fail(("fp16", "clip_grad_norm"), f"is {py(norm)} while the top-level clip_grad_norm is {py(top)}",
                      "keep one: the top-level clip_grad_norm")
        rest = {k: v for k, v in value.items() if k != "clip_grad_norm"}
        self.config["fp16"] = rest
        if norm > 0:
            self.config["clip_grad_norm"] = norm
        get_dist_logger().info(f"{self.config._where('fp16', 'clip_grad_norm')}: config key 'fp16.clip_grad_norm': the "
                               f"legacy naive fp16 option is read as clip_grad_norm = {py(norm)} (the top-level key)",
                               ranks=[0])
        return rest

    def _unknown_amp_option(self, mode, opt, options):
        if opt in FEATURE_KEYS:  # a feature key inside fp16 does nothing: it works at the top level, with its value
            v, top = self.config["fp16"][opt], self.config.get(opt)
            fix = (f"write --set {opt}={cli_spelling(v)}" if self.from_command_line(("fp16", opt)) else
                   f"remove it here: the top-level {opt} = {py(top)} is the one read" if opt in self.config else
                   f"move it to the top level of the config file: {opt} = {py(v)}")
            self.fail(("fp16", opt), f"is a top-level config key, not an option of mode {mode.name if mode else None}, "
                      f"so inside fp16 it would have no effect", fix)
        accepted = ", ".join(options) or "no options"
        owner = next((m for m, opts in ((AMP_TYPE.TORCH, TORCH_AMP_OPTIONS), (AMP_TYPE.NAIVE, NAIVE_AMP_OPTIONS))
                      if opt in opts), None)
        where = f"; '{opt}' is an option of mode={py(owner)}" if owner else ""
        self.fail(("fp16", opt), f"not an option of mode {mode.name if mode else None}",
                  f"remove it{self._suggest(opt, options)} (accepted: {accepted}){where}")

    def _amp_option(self, opt, v, options):
        """One loss-scaler option: its type and range."""
        if opt in ("enabled", "dynamic_grad_scale", "verbose", "log_num_zeros_in_grad"):
            if not _is_bool(v):
                meant = as_bool(v)
                fix = (self.write(("fp16", opt), meant, True) if meant is not None or
                       self.from_command_line(("fp16", opt)) else f"write {opt}=True or {opt}=False")
                self.fail(("fp16", opt), f"expected True or False, got {v!r}", fix)
        elif opt in ("min_scale", "max_scale") and v is None:
            pass
        elif opt in ("growth_interval", "hysteresis"):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                self.fail(("fp16", opt), f"expected a positive int, got {v!r}", self.write(("fp16", opt), as_positive_int(v), options[opt]))
        elif not _is_number(v) or v <= 0:
            self.fail(("fp16", opt), f"expected a positive number, got {v!r}", self.write(("fp16", opt), as_positive_number(v), options[opt]))

    def clip_grad_norm(self, value):
        if not _is_number(value) or value < 0:
            meant = as_number(value)
            self.fail(("clip_grad_norm",), f"expected a number >= 0 (the max global L2 norm; 0 turns clipping off), got {value!r}",
                      self.write(("clip_grad_norm",), meant if meant is not None and meant >= 0 else None, 1.0) +
                      ("" if meant is not None and meant >= 0 else " (0 turns clipping off)"))

    def gradient_accumulation(self, value):
        if value == "auto":
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            meant = as_choice(value, ("auto",)) if isinstance(value, str) and value.strip().isalpha() else as_positive_int(value)
            if meant is None and value == 0:
                meant = 1  # 0 micro-batches of accumulation: the user means none
            self.fail(("gradient_accumulation",), f"expected a positive int (micro-batches per optimizer step) or 'auto', "
                      f"got {value!r}", self.write(("gradient_accumulation",), meant, 4))

    def cudnn_benchmark(self, value):
        self.flag(("cudnn_benchmark",), value)

    def cudnn_deterministic(self, value):
        self.flag(("cudnn_deterministic",), value)

    def torch_ddp(self, value):
        if not isinstance(value, dict):
            self.fail(("torch_ddp",), f"expected a dict of DistributedDataParallel keyword arguments, got {type(value).__name__}",
                      "write e.g. torch_ddp = dict(find_unused_parameters=True)")
        defaults = ddp_defaults()
        reserved = {"process_group", "device_ids", "output_device"}
        for k, v in value.items():
            if k in reserved:
                self.fail(("torch_ddp", k), "is set by colossal_lite from the launch (one device per process)", "remove it")
            if k not in defaults:
                self.fail(("torch_ddp", k), "is not a keyword argument of torch DistributedDataParallel",
                          f"remove it{self._suggest(k, set(defaults) - reserved)}")
            check_ddp_option(self, k, v, defaults[k])

    def gradient_handler(self, value):
        if not isinstance(value, (list, tuple)):
            got = "a single dict" if isinstance(value, dict) else type(value).__name__
            self.fail(("gradient_handler",), f"expected a list of dicts, got {got}", _handler_fix([value]))
        for index, item in enumerate(value):
            if not isinstance(item, dict) or "type" not in item:
                self.fail(("gradient_handler",), f"each entry must be a dict with a 'type', got {item!r}", _handler_fix(value))
            known = registered_handlers()
            if item["type"] not in known:
                # checked at launch, so a handler is found only if the script registered it before calling launch
                self.fail(("gradient_handler",), f"unknown handler type {item['type']!r}",
                          f"use one of {', '.join(known)}{self._suggest(str(item['type']), known)} "
                          f"(tensor/pipeline/MoE handlers are not supported), or register your own "
                          f"BaseGradientHandler subclass with @GRADIENT_HANDLER.register_module "
                          f"(from colossal_lite.registry) before calling launch")
            accepted = _handler_options(item["type"])
            extra = set(item) - {"type"} - (accepted if accepted is not None else set(item))
            if extra:
                hints = "".join(self._suggest(k, sorted(accepted)) for k in sorted(extra))
                listed = ", ".join(["type", *sorted(accepted)])
                self.fail(("gradient_handler",), f"unknown option(s) {sorted(extra)} for {item['type']}",
                          f"remove them{hints} (accepted: {listed})")
            builtin = item["type"] in GRADIENT_HANDLERS
            check_handler_options(self, index, item, None if builtin else GRADIENT_HANDLER.get_module(item["type"]))

    def parallel(self, value):
        if not isinstance(value, dict):
            self.fail(("parallel",), f"expected a dict, got {type(value).__name__}", "remove the key (data parallelism needs no config)")
        for k, v in value.items():
            if k == "data":
                continue
            if k not in ("pipeline", "tensor"):
                self.fail(("parallel", k), "unknown parallel mode", "remove it; only data parallelism is supported")
            size = v.get("size", 1) if isinstance(v, dict) else v
            if size is None or size == 1 and isinstance(size, int) and not _is_bool(size):
                continue
            if as_positive_int(size) not in (None, 1):
                self.fail(("parallel", k), f"{k} parallelism (size {size!r}) is not supported by colossal_lite",
                          f"remove parallel.{k}; scale with data parallelism and zero=dict(stage=...) instead")
            path = ("parallel", k, "size") if isinstance(v, dict) else ("parallel", k)
            self.fail(path, f"expected the int 1 (no {k} parallelism) or None, got {size!r}",
                      f"remove parallel.{k} (only data parallelism is supported)")

    def zero(self, value):
        if not isinstance(value, dict):
            stage = as_positive_int(value)
            self.fail(("zero",), f"expected a dict like dict(stage=2), got {type(value).__name__}",
                      self.write(("zero",), dict(stage=stage) if stage in (1, 2, 3) else None, dict(stage=2)))
        if "model_config" in value or "optimizer_config" in value:
            self.fail(("zero",), "the legacy ShardedModelV2 form (model_config/optimizer_config) is not supported",
                      "write zero = dict(stage=1|2|3) to use torch's ZeroRedundancyOptimizer / FSDP2")
        for k in value:
            if k not in ZERO_OPTIONS and k not in LEGACY_ZERO_KEYS:
                self.fail(("zero", k), "not an option of zero", f"remove it{_zero_suggestion(k)} "
                          f"(accepted: {', '.join(ZERO_OPTIONS)})")
        if any(k in value for k in LEGACY_ZERO_KEYS):
            value = self._legacy_zero(value)
        if not _is_stage(value.get("stage")):
            stage = as_positive_int(value.get("stage"))
            stage = stage if stage in (1, 2, 3) else None
            fix = (self.write(("zero", "stage"), stage, 2) if self.from_command_line(("zero", "stage")) else
                   self.write(("zero", "stage"), stage and {**value, "stage": stage}, {**value, "stage": 2}, key=("zero",)))
            self.fail(("zero", "stage"), f"expected 1, 2 or 3, got {value.get('stage')!r}", fix)
        check_zero_options(self, value)

    def _legacy_zero(self, value: dict) -> dict:
        """``zero = dict(level=..., cpu_offload=..., verbose=...)`` rewritten in today's names, in the config itself,
        with an info line that shows the new form."""
        mapped = {}
        for k, v in value.items():
            new = LEGACY_ZERO_KEYS.get(k, k)
            if k in LEGACY_ZERO_KEYS and new in value:
                self._legacy_and_new_zero_key(k, new, value)
            if k == "level" and not _is_stage(v):
                level = as_positive_int(v)
                self.fail(("zero", "level"), f"expected 1, 2 or 3 (the ZeRO stage), got {v!r}",
                          self.write(("zero", "level"), dict(stage=level) if level in (1, 2, 3) else None, dict(stage=2),
                                     key=("zero",)))
            if k in ("cpu_offload", "verbose") and not _is_bool(v):
                self.fail(("zero", k), f"expected True or False, got {v!r}", self.write(("zero", k), as_bool(v), False))
            if new is not None and not (k == "cpu_offload" and v is False):  # False is offload_optimizer's default
                mapped[new] = v
        self.config["zero"] = mapped
        get_dist_logger().info(f"{self.config._where('zero')}: config key 'zero': the legacy form {py(dict(value))} is "
                               f"read as zero = {py(mapped)}" + (" (verbose has no effect)" if "verbose" in value else ""),
                               ranks=[0])
        return mapped

    def _legacy_and_new_zero_key(self, legacy: str, new: str, value: dict):
        """Both names of one zero option. When an override set one of them, removing the other from the file is no
        fix a command line can give: the override that works sets the name the file uses."""
        by_override = {name: self.config._source.override_of(("zero", name)) if self.from_command_line(("zero", name))
                       else None for name in (legacy, new)}
        problem = f"is the legacy name of '{new}', which is set too"
        if by_override[legacy] and by_override[new]:
            self.fail(("zero",), problem, f"keep one of --set {by_override[legacy]} and --set {by_override[new]}",
                      key=f"zero.{legacy}")
        for given, used in ((new, legacy), (legacy, new)):
            if by_override[given]:
                self.fail(("zero",), f"is the legacy name of '{new}'; --set {by_override[given]} sets "
                          f"'{given}' while the config sets '{used}'", f"write --set zero.{used}="
                          f"{cli_spelling(value[given])} instead (the name the config uses)", key=f"zero.{legacy}")
        self.fail(("zero", legacy), problem, f"remove '{legacy}'")

    def dist_timeout(self, value):
        if not _is_number(value) or value <= 0:
            self.fail(("dist_timeout",), f"expected seconds > 0, got {value!r}", self.write(("dist_timeout",), as_seconds(value), DEFAULTS["dist_timeout"]))

    def _positive_int(self, key, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.fail((key,), f"expected a positive int, got {value!r}", self.write((key,), as_positive_int(value), 32))

    def micro_batch_size(self, value):
        self._positive_int("micro_batch_size", value)

    def global_batch_size(self, value):
        self._positive_int("global_batch_size", value)

    def grad_reduction(self, value):
        choices = ("mean", "sum", "per-token-mean")
        if value not in choices:
            meant = as_choice(value, choices, {"avg": "mean", "average": "mean", "token-mean": "per-token-mean"})
            self.fail(("grad_reduction",), f"expected 'mean', 'sum' or 'per-token-mean', got {value!r}",
                      self.write(("grad_reduction",), meant, DEFAULTS["grad_reduction"]))

    def nonfinite_loss(self, value):
        choices = ("raise", "skip", "ignore")
        if value not in choices:
            meant = as_choice(value, choices, {"error": "raise", "fail": "raise", "stop": "raise", "skip-step": "skip",
                                               "none": "ignore", "off": "ignore"})
            self.fail(("nonfinite_loss",), f"expected 'raise', 'skip' or 'ignore' (what to do when a loss is inf or "
                      f"NaN), got {value!r}", self.write(("nonfinite_loss",), meant, DEFAULTS["nonfinite_loss"]))

    def compile(self, value):
        if _is_bool(value):
            return
        allowed = {"mode", "fullgraph", "dynamic", "backend", "options"}
        if not isinstance(value, dict):
            mode = as_choice(value, compile_modes())
            meant = dict(mode=mode) if mode else as_bool(value) if isinstance(value, int) else None
            self.fail(("compile",), f"expected True/False or a dict of torch.compile options, got {type(value).__name__}",
                      self.write(("compile",), meant, dict(mode="default")))
        for k, v in value.items():
            if k not in allowed:
                self.fail(("compile", k), "not an option of torch.compile",
                          f"remove it{self._suggest(k, allowed)} (accepted: {', '.join(sorted(allowed))})")
            check_compile_option(self, k, v)
        mode = value.get("mode")
        if mode is not None and value.get("options") is not None:
            self.fail(("compile", "mode"), "torch.compile takes 'mode' or 'options', not both",
                      "remove one of them (a mode is a named set of inductor options)")
        # a mode names a preset of the inductor backend; another backend reads it in its own way
        if mode is not None and value.get("backend", "inductor") == "inductor" and mode not in compile_modes():
            self.fail(("compile", "mode"), f"unknown torch.compile mode {mode!r}",
                      self.write(("compile", "mode"), as_choice(mode, compile_modes()), "default") +
                      f" (accepted: {', '.join(compile_modes())})")

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _suggest(name, candidates) -> str:
        close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
        return f" (did you mean '{close[0]}'?)" if close else ""


def _on_rank_0() -> bool:
    """Rank 0, also before the process group exists (torchrun's ``RANK``): every rank checks the config, and a
    warning is said once."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def compile_modes() -> List[str]:
    """The modes the installed torch.compile accepts for its default (inductor) backend; torch._inductor is
    imported here, when a config asks for a mode, because importing it costs seconds."""
    from torch._inductor import list_mode_options

    return ["default", *(m for m in list_mode_options() if m != "default")]


def _dotted(path, value):
    """``(dotted key, value)`` for each leaf of ``value`` set at ``path``: a dict is set key by key on a command line."""
    if isinstance(value, dict) and value:
        return [item for k, v in value.items() for item in _dotted((*path, k), v)]
    return [(".".join(path), value)]


def _mode_of_options(options: dict) -> Optional[AMP_TYPE]:
    """The one precision mode that takes all of ``options``, if exactly one does."""
    fits = [m for m, opts in ((AMP_TYPE.TORCH, TORCH_AMP_OPTIONS), (AMP_TYPE.NAIVE, NAIVE_AMP_OPTIONS))
            if set(options) <= set(opts)]
    return fits[0] if len(fits) == 1 else None


def _zero_suggestion(name: str) -> str:
    """The ``zero`` option a misspelt ``name`` meant, by today's name: a name close to a legacy key (``offload`` is
    close to ``cpu_offload``) means that key's successor (``offload_optimizer``), which is what a fix should teach."""
    close = difflib.get_close_matches(name, [*ZERO_OPTIONS, *LEGACY_ZERO_KEYS], n=1, cutoff=0.6)
    meant = LEGACY_ZERO_KEYS.get(close[0], close[0]) if close else None
    return f" (did you mean '{meant}'?)" if meant else ""


def _cli_mode_fix(meant: Optional[str]) -> str:
    """The fix of a precision mode given with ``--set``, where the config file's names (``AMP_TYPE.BF16``) are not
    known and a mode is written by its value (``fp16.mode=bf16``); ``meant`` as ``amp_mode_meant`` gives it."""
    if meant is None:
        return ("write --set fp16.mode=torch, --set fp16.mode=bf16, --set fp16.mode=naive or --set fp16=None "
                "(AMP_TYPE names are not known on the command line)")
    if meant == "None":
        return "write --set fp16=None (fp32)"
    return f"write --set fp16.mode={cli_spelling(AMP_TYPE[meant.split('.')[-1]])}"


def _apex_fix(opt_level) -> str:
    """apex O1 is torch autocast + GradScaler; O2/O3 keep fp16 weights, like NAIVE."""
    level = str(opt_level).strip().upper() if opt_level is not None else ""
    if level == "O1":
        return "write mode=AMP_TYPE.TORCH (torch autocast + GradScaler, what apex O1 does) and drop opt_level"
    if level in ("O2", "O3"):
        return f"write mode=AMP_TYPE.NAIVE (fp16 weights with fp32 master weights, like apex {level}) and drop opt_level"
    return "use AMP_TYPE.TORCH (torch autocast + GradScaler, the same O1 behaviour) or AMP_TYPE.NAIVE (O3-like)"


def registered_handlers() -> List[str]:
    """The gradient handler types a config may name now: the built-in one, then those registered, sorted."""
    return list(GRADIENT_HANDLERS) + [n for n in GRADIENT_HANDLER.names() if n not in GRADIENT_HANDLERS]


def _handler_options(name: str) -> Optional[set]:
    """The options (besides ``type``) a handler's entry may give: its constructor's keyword arguments other than
    ``model`` and ``optimizer``, which the engine passes; None when it takes any (``**kwargs``)."""
    if name == "DataParallelGradientHandler":
        return {"bucket_size_mb"}
    params = inspect.signature(GRADIENT_HANDLER.get_module(name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"model", "optimizer"}


def _handler_fix(entries) -> str:
    """``gradient_handler = [dict(type=..., ...)]`` built from what the user wrote (a dict, a name, a list of them)."""
    fixed = []
    for entry in entries:
        if isinstance(entry, str):
            name = next((h for h in GRADIENT_HANDLERS if h.lower() == entry.strip().lower()), None)
            entry = dict(type=name) if name else None
        elif isinstance(entry, dict):
            entry = {"type": "DataParallelGradientHandler", **entry}
        else:
            entry = None
        if entry is None:
            return "write gradient_handler = [dict(type='DataParallelGradientHandler')]"
        fixed.append(entry)
    return f"write gradient_handler = {py(fixed)}"


# The feature keys; each has a check of the same name on _Checker.
FEATURE_KEYS = (
    "fp16", "clip_grad_norm", "gradient_accumulation", "cudnn_benchmark", "cudnn_deterministic", "torch_ddp",
    "gradient_handler", "parallel", "zero", "dist_timeout", "micro_batch_size", "global_batch_size",
    "grad_reduction", "compile", "nonfinite_loss",
)


def normalize_amp_mode(mode, fail: Optional[Callable[[str, str], None]] = None) -> Optional[AMP_TYPE]:
    """``AMP_TYPE`` member, or its value as a string ('torch', 'bf16', 'naive'), or None -> AMP_TYPE/None."""
    if mode is None or isinstance(mode, AMP_TYPE):
        return mode
    if isinstance(mode, str):
        for m in AMP_TYPE:
            if mode.lower() in (m.value, m.name.lower()):
                return m
    problem = f"unknown precision mode {mode!r}"
    meant = amp_mode_meant(mode)
    fix = (f"write mode={meant}" + (" (from colossal_lite.amp import AMP_TYPE)" if meant != "None" else "") if meant else
           "use AMP_TYPE.TORCH, AMP_TYPE.BF16, AMP_TYPE.NAIVE or None (from colossal_lite.amp import AMP_TYPE)")
    if fail is not None:
        fail(problem, fix)
    raise ConfigException(f"{problem}. Fix: {fix}")


def validate_config(config: Config) -> List[str]:
    """Raise ``ConfigException`` on the first bad feature key; return the warnings issued."""
    checker = _Checker(config)
    notes: List[str] = []
    for key, value in list(config.items()):  # (a legacy form may add the key it is read as)
        if not isinstance(key, str) or key.isupper() or key.startswith("_"):
            continue
        if key in FEATURE_KEYS:
            if value is None and key != "fp16":
                # KEY = None (in the file, in a dict or by --set KEY=None) takes the key away: its default applies,
                # which is "off" for every feature; fp16 = None is a value of its own (fp32) and stays
                del config[key]
                continue
            getattr(checker, key)(value)
            continue
        _check_unknown_key(checker, key)
        if key in FOREIGN_KEYS:
            msg = (f"{config._where(key)}: config key '{key}' is not a colossal_lite option (kept as your own value); "
                   f"colossal_lite's is {foreign_key_fix(key, value)}. Fix: write that instead, or, if '{key}' is "
                   f"your own value, write it in UPPERCASE or filter ForeignConfigKeyWarning (from "
                   f"colossal_lite.context)")
            # attributed to this line, so Python's default filter shows each message once however often the config
            # is checked (launch_from_torch checks it before launch does)
            if _on_rank_0():
                warnings.warn(msg, ForeignConfigKeyWarning, stacklevel=1)
            notes.append(msg)
    # a feature dict nested inside another top-level dict does nothing (CONFIG = dict(fp16=...))
    for key, value in config.items():
        if isinstance(key, str) and key not in FEATURE_KEYS and isinstance(value, dict):
            nested = [k for k in value if k in FEATURE_KEYS]
            for k in nested:
                msg = (f"{config._where(key, k)}: config key '{key}.{k}' looks like a feature setting but is nested inside "
                       f"'{key}', so it has no effect. Fix: move '{k}' to the top level of the config file")
                warnings.warn(msg, UserWarning, stacklevel=3)
                notes.append(msg)
    if config.get("gradient_handler") is not None and config.get("torch_ddp"):
        checker.fail(("torch_ddp",), "is ignored when 'gradient_handler' is set (gradients are all-reduced by the handler, not DDP)",
                     "remove one of 'torch_ddp' and 'gradient_handler'")
    _check_combinations(checker, config)
    return notes


def load_config(config: Union[str, Path, dict, Config, None], overrides: Optional[Iterable[str]] = None) -> Config:
    """A path to a ``.py`` file, a dict or a Config, with ``--set KEY=VALUE`` ``overrides`` -> a validated ``Config``.

    The overrides are applied before the check, so a wrong one is refused like a wrong line, naming the override.
    """
    if config is None:
        config = Config()
    elif isinstance(config, (str, Path)):
        config = Config.from_file(config)
    elif isinstance(config, dict):
        config = Config(config)
    else:
        raise TypeError(f"config must be a path to a .py file, a dict or a Config, got {type(config).__name__}")
    config = apply_overrides(config, overrides)
    validate_config(config)
    return config


def _meant_key(key: str) -> Optional[str]:
    """The feature key a lowercase name that is not one most likely meant: an alias or a close misspelling."""
    return ALIASES.get(key) or (difflib.get_close_matches(key, FEATURE_KEYS, n=1, cutoff=0.8) or [None])[0]


def _check_unknown_key(checker: _Checker, key: str):
    """A name that is not a feature key is the user's own, unless it is a near-miss of one.

    Names are compared in lowercase, so a mixed-case name (``Clip_Grad_Norm``) that means a feature
    key is refused like a misspelling; only all-UPPERCASE names are kept unchecked.
    """
    lowered = key.lower()
    meant = lowered if lowered in FEATURE_KEYS else _meant_key(lowered)
    if meant is None:
        return
    if lowered != key:
        checker.fail((key,), "is not a colossal_lite config key: feature keys are lowercase, so this mixed-case name "
                     "would be silently ignored", f"rename it to '{meant}' (or write {key.upper()} in UPPERCASE to "
                     f"keep it as your own value)")
    checker.fail((key,), "is not a colossal_lite config key, so it would be silently ignored", f"rename it to '{meant}'")


def _check_combinations(checker: _Checker, config: Config):
    """Feature pairs that cannot work together, found at check time."""
    zero = config.get("zero")
    if not zero:
        return
    stage = zero.get("stage")
    fp16 = config.get("fp16") or {}
    if stage in (2, 3) and fp16 and normalize_amp_mode(fp16.get("mode")) is AMP_TYPE.NAIVE:
        checker.fail(("fp16", "mode"), "AMP_TYPE.NAIVE keeps fp16 weights with fp32 master copies, which FSDP2's sharded "
                     "parameters (zero stages 2 and 3) cannot hold", "use fp16=dict(mode=AMP_TYPE.TORCH) or "
                     "AMP_TYPE.BF16 with zero stage 2/3, or zero=dict(stage=1) with AMP_TYPE.NAIVE")
    if config.get("gradient_handler") is not None:
        checker.fail(("gradient_handler",), "ZeRO reduces gradients itself (DDP for stage 1, FSDP2 for stages 2 and 3)",
                     "remove 'gradient_handler' when 'zero' is set")
    if stage == 1 and (zero.get("offload_optimizer") or zero.get("shard_modules") or
                       zero.get("reshard_after_forward") is not None):
        checker.fail(("zero",), "offload_optimizer, shard_modules and reshard_after_forward are FSDP2 options, but stage 1 "
                     "is torch's ZeroRedundancyOptimizer", "use zero=dict(stage=2) or stage=3 for them, or remove them")
    if stage in (2, 3) and config.get("gradient_accumulation") == "auto":
        checker.fail(("gradient_accumulation",), "'auto' retries a batch after an out-of-memory error, but FSDP2 runs "
                     "collectives inside forward and backward, so a rank that ran out would leave the others waiting",
                     "use a fixed gradient_accumulation with zero stage 2/3, or zero=dict(stage=1)")
    if stage in (2, 3) and config.get("torch_ddp"):
        checker.fail(("torch_ddp",), "DDP options have no effect with zero stage 2/3 (FSDP2 replaces DDP)",
                     "remove 'torch_ddp'")
