"""A checkpoint's model weights as a Hugging Face model folder, for ``from_pretrained`` and the rest of that ecosystem.

``export_hf`` reads the weights the way ``ckpt export`` does (sharded ZeRO checkpoints merged, ``ema=True`` for an
``EMAHook``'s average), loads them into the model class built from its Hugging Face config, and writes that model
with its own ``save_pretrained``: ``config.json`` and the weights (``model.safetensors`` when safetensors is
installed, as transformers chooses). transformers is imported only here, when a folder is exported.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Union

from .io import CheckpointError, PathLike
from .weights import read_weights

__all__ = ["export_hf", "HFExport"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class HFExport(NamedTuple):
    """What ``export_hf`` wrote: the folder, the model class, the weights file and the tensors' source."""

    folder: Path
    model_class: str
    weights_file: str
    tensors: int
    source: str  # 'model', or the key of the EMA hook whose average was written


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise CheckpointError(f"exporting a Hugging Face folder needs transformers ({error}); install it with "
                              f"pip install -e \".[hf]\" (or pip install transformers)") from None
    return transformers


def _config(config: Any):
    """A ``PretrainedConfig``: ``config`` itself, or read from a config.json file or a folder that holds one."""
    transformers = _transformers()
    if isinstance(config, transformers.PretrainedConfig):
        return config
    path = Path(config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"no Hugging Face config at {config}: give a config.json file or a folder holding one "
                              f"(model.config.save_pretrained(folder) writes it)")
    return transformers.AutoConfig.from_pretrained(str(file))


def _model_class(transformers, config, model_class: Union[None, str, type]) -> type:
    if isinstance(model_class, type):
        return model_class
    name = model_class or (config.architectures or [None])[0]
    if name is None:
        raise CheckpointError("the Hugging Face config names no model class (its 'architectures' is empty): name it, "
                              "e.g. --hf-class GPT2LMHeadModel (model_class='GPT2LMHeadModel')")
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type):
        raise CheckpointError(f"transformers has no model class {name!r}: name one it has, e.g. GPT2LMHeadModel or "
                              f"BertForSequenceClassification")
    return cls


def export_hf(path: PathLike, out: PathLike, config: Any, model_class: Union[None, str, type] = None,
              ema: Union[bool, str] = False, progress: bool = True) -> HFExport:
    """Write the weights of the checkpoint ``path`` as the Hugging Face folder ``out``.

    ``config``: the model's ``PretrainedConfig``, or a config.json file or a folder holding one. ``model_class``: the
    transformers class (or its name) to build from it; None takes the config's ``architectures``. ``ema``: as
    ``load_weights``. The weights must fit the class exactly (every key, no extra one), or nothing is written.
    ``progress=False`` turns transformers' progress bars off (for the whole process: the command line's choice).
    """
    transformers = _transformers()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    if Path(out).exists() and not Path(out).is_dir():
        raise CheckpointError(f"the output {out} is a file, and a Hugging Face export is a folder: nothing was "
                              f"written; give a folder path")
    cfg = _config(config)
    cls = _model_class(transformers, cfg, model_class)
    weights = read_weights(path, ema)
    try:
        model = cls(cfg)
    except (AttributeError, TypeError, ValueError) as error:  # (a class of another architecture than the config's)
        raise CheckpointError(f"{cls.__name__} cannot be built from this config ({type(cfg).__name__}): {error}. Give "
                              f"the class the config describes (--hf-class)") from None
    try:
        missing, unexpected = model.load_state_dict(weights.state, strict=False)
    except RuntimeError as error:  # the names fit, some shapes do not: torch lists them
        raise CheckpointError(f"the checkpoint's weights do not fit {cls.__name__} built from this config: "
                              f"{str(error).strip().splitlines()[-1].strip()} (and maybe more). Give the config of "
                              f"the model that was trained") from None
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's weights do not fit {cls.__name__} built from this config: missing "
                              f"{_few(missing)}, unexpected {_few(unexpected)}. Give the config and class of the "
                              f"model that was trained")
    model.save_pretrained(str(out))
    written = next((name for name in WEIGHT_FILES if (Path(out) / name).exists()), None)
    if written is None:
        raise CheckpointError(f"transformers wrote no weights file into {out} (save_pretrained said why above)")
    return HFExport(Path(out), cls.__name__, written, len(weights.state), weights.source)


def _few(names, shown: int = 4) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(list(names)[:shown]) + more


def describe(result: HFExport) -> str:
    """The line ``ckpt export --hf`` prints."""
    what = "" if result.source == "model" else f" (the EMA weights of {result.source})"
    return (f"wrote {result.model_class} with {result.tensors} tensors{what} to {result.folder} ({result.weights_file}, "
            f"config.json); load it with transformers.{result.model_class}.from_pretrained({str(result.folder)!r})")
