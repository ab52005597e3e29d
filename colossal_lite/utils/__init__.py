"""Legacy ``colossalai.utils`` helpers."""
from .checkpointing import (
    get_checkpoint_path,
    get_latest_checkpoint_path,
    get_latest_checkpoint_pattern,
    load_checkpoint,
    save_checkpoint,
)
from .common import (
                     barrier,
                     clip_grad_norm_fp32,
                     conditional_context,
                     free_port,
                     get_current_device,
                     is_dp_rank_0,
                     is_no_pp_or_last_stage,
                     is_tp_rank_0,
                     is_using_ddp,
                     is_using_pp,
                     is_using_sequence,
                     print_rank_0,
                     sync_model_param,
)
from .data import DataParallelSampler, ResumableDataLoader, batches_per_epoch, get_dataloader, seed_worker, skip_batches
from .memory import report_memory_usage
from .timer import MultiTimer, Timer

__all__ = [
    "get_current_device", "free_port", "print_rank_0", "is_using_ddp", "is_using_pp", "is_using_sequence",
    "is_dp_rank_0", "is_tp_rank_0", "is_no_pp_or_last_stage", "sync_model_param", "conditional_context",
    "clip_grad_norm_fp32", "barrier", "get_dataloader", "DataParallelSampler", "seed_worker", "report_memory_usage",
    "MultiTimer", "Timer", "save_checkpoint", "load_checkpoint", "ResumableDataLoader", "batches_per_epoch",
    "skip_batches", "get_checkpoint_path", "get_latest_checkpoint_path", "get_latest_checkpoint_pattern",
]
