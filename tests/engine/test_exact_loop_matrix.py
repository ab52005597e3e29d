"""Issue 28's proof: colossal_lite equals the hand-written PyTorch loop it replaces, bit for bit and by mechanism.

{fp32, bf16, fp16 torch AMP} x {one process, DDP, gradient handler, ZeRO 1, 2, 3} x {accumulation 1, accumulation 3
with a partial last window}, clipping on, BatchNorm and two param groups, through the engine loop and through
``Trainer.fit``, each against the loop of ``exact_loop.py``. Parameters and buffers (BatchNorm's running statistics
included) are compared with ``torch.equal``; the collectives of each micro-step (every ``torch.distributed`` call
made from Python, and each DDP gradient bucket, seen by a comm hook) are compared with the hand loop's; the losses
a user reads are compared exactly. Reductions of DTensors (FSDP2's clip norm) go through torch's functional
collectives, which neither side's count includes. Every case is bitwise: none needs a tolerance.
"""
import json
from pathlib import Path

import exact_loop
import pytest
from dist_helpers import run_ranks

TESTS = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """All data-parallel cases in one 2-rank launch; each rank's results."""
    out = tmp_path_factory.mktemp("exact_loop") / "result"
    run_ranks(TESTS / "exact_loop.py", [out, ",".join(exact_loop.PARALLEL)], nproc=2, timeout=300)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]


def _assert_exact(result: dict, key: str, rank: int) -> None:
    assert "error" not in result, f"{key} failed on rank {rank}:\n{result['trace']}"
    assert any("running_mean" in n for n in result["names"])  # buffers are compared too
    assert result["differ"] == {}, f"{key} rank {rank}: tensors differ from the hand loop (max abs diff): " \
                                   f"{result['differ']}"
    assert result["lib_losses"] == result["hand_losses"], f"{key} rank {rank}: losses differ"
    assert len(result["lib_collectives"]) == exact_loop.MICRO_BATCHES
    assert result["lib_collectives"] == result["hand_collectives"], \
        f"{key} rank {rank}: collectives per micro-step\n  hand {result['hand_collectives']}\n" \
        f"  lib  {result['lib_collectives']}"


@pytest.mark.parametrize("loop", exact_loop.LOOPS)
@pytest.mark.parametrize("acc", exact_loop.ACCUMULATIONS)
@pytest.mark.parametrize("parallel", exact_loop.PARALLEL)
@pytest.mark.parametrize("prec", exact_loop.PRECISIONS)
def test_two_ranks_equal_the_hand_loop(two_ranks, prec, parallel, acc, loop):
    key = f"{prec}/{parallel}/{acc}/{loop}"
    for rank, results in enumerate(two_ranks):
        _assert_exact(results[key], key, rank)


@pytest.mark.parametrize("kind", ("ddp", "zero1"))
@pytest.mark.parametrize("loop", exact_loop.LOOPS)
def test_ddp_all_reduces_once_per_window_and_broadcasts_buffers_at_window_starts(two_ranks, kind, loop):
    """The mechanism itself: with windows of 3, 3 and 1, DDP's gradient buckets are all-reduced only at each
    window's last micro-step, and BatchNorm's buffers broadcast only where the hand loop's forward syncs."""
    result = two_ranks[0][f"fp32/{kind}/3/{loop}"]
    assert [s.get("ddp_grad_bucket", 0) for s in result["lib_collectives"]] == [0, 0, 1, 0, 0, 1, 1]
    assert [s.get("_broadcast_coalesced", 0) for s in result["lib_collectives"]] == [1, 0, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("stage", (2, 3))
def test_fsdp_reduce_scatters_only_at_window_ends(two_ranks, stage):
    result = two_ranks[1][f"bf16/zero{stage}/3/trainer"]
    scatters = [s.get("reduce_scatter_single", 0) for s in result["lib_collectives"]]
    assert [n > 0 for n in scatters] == [False, False, True, False, False, True, True]


@pytest.mark.gpu  # on a machine with CUDA both loops run there (exact_loop.device())
@pytest.mark.parametrize("loop", exact_loop.LOOPS)
@pytest.mark.parametrize("acc", exact_loop.ACCUMULATIONS)
@pytest.mark.parametrize("prec", exact_loop.PRECISIONS)
def test_one_process_equals_the_hand_loop(launched, prec, acc, loop):
    launched({})
    key = f"{prec}/single/{acc}/{loop}"
    _assert_exact(exact_loop.compare(prec, "single", acc, loop, rank=0), key, 0)


def test_a_forward_that_bypasses_the_engine_still_syncs(two_ranks):
    """``engine.model(x)`` for a window's last micro-batch: no forward through the engine said where it stands, and
    the sync that the previous micro-batch switched off is back on, so its backward all-reduces."""
    for results in two_ranks:
        assert results["bypass"] == dict(buckets=[0, 1, 0, 1], updates=2)
