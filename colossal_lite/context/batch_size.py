"""Batch-size arithmetic: global = micro x data-parallel size x accumulation; any two give the third."""
from __future__ import annotations

from .config import Config, ConfigException

KEYS = ("micro_batch_size", "global_batch_size", "gradient_accumulation")


def resolve_batch_sizes(config: Config, world_size: int) -> Config:
    """Fill in the missing one of micro_batch_size / global_batch_size / gradient_accumulation.

    Inconsistent values raise ``ConfigException`` showing the arithmetic. With ``gradient_accumulation='auto'``
    the split of a batch is found at run time, so the sizes are not checked against each other (the launch summary
    lists them).
    """
    micro = config.get("micro_batch_size")
    glob = config.get("global_batch_size")
    accum = config.get("gradient_accumulation")
    auto = accum == "auto"
    if micro is None and glob is None:
        return config
    if glob is not None and micro is None:
        if accum is None or auto:
            # a micro size that gives the global one exactly, or the nearest global sizes that one does
            fix = (f"add micro_batch_size = {glob // world_size} (for data-parallel size {world_size})"
                   if glob % world_size == 0 else
                   f"global_batch_size {glob} is not a multiple of data-parallel size {world_size}: use e.g. "
                   f"global_batch_size = {max(world_size, glob - glob % world_size)} with micro_batch_size = "
                   f"{max(1, glob // world_size)}")
            raise ConfigException(f"{config._where('global_batch_size')}: config key 'global_batch_size' = {glob} needs "
                                  f"micro_batch_size or gradient_accumulation to fix the other factors. Fix: {fix}")
        per = world_size * accum
        if glob % per:
            raise ConfigException(
                f"{config._where('global_batch_size')}: config key 'global_batch_size': {glob} is not divisible by "
                f"data-parallel size {world_size} x gradient_accumulation {accum} = {per}. Fix: use a global_batch_size "
                f"that is a multiple of {per} (e.g. {max(per, glob - glob % per)})")
        config["micro_batch_size"] = glob // per
        return config
    if micro is not None and glob is None:
        if not auto:
            config["global_batch_size"] = micro * world_size * (accum or 1)
        return config
    # both sizes given
    if auto:
        return config
    if accum is None:
        per = micro * world_size
        if glob % per:
            raise ConfigException(
                f"{config._where('global_batch_size')}: config key 'global_batch_size': {glob} is not divisible by "
                f"micro_batch_size {micro} x data-parallel size {world_size} = {per}, so no whole gradient_accumulation "
                f"fits. Fix: use a global_batch_size that is a multiple of {per}")
        config["gradient_accumulation"] = glob // per
        return config
    expected = micro * world_size * accum
    if expected != glob:
        raise ConfigException(
            f"{config._where('global_batch_size')}: config key 'global_batch_size': micro_batch_size {micro} x "
            f"data-parallel size {world_size} x gradient_accumulation {accum} = {expected}, not {glob}. Fix: set "
            f"global_batch_size = {expected}, or leave one of the three out and it will be computed")
    return config
