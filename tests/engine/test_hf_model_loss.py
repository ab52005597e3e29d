"""Issue 33's table, each row against the hand-written Hugging Face loop (tests/hf_loop.py), bit for bit on
parameters and buffers: a model that computes its own loss trains with no criterion; a criterion on a
``ModelOutput``'s logits; ``AccuracyHook`` on a ``ModelOutput``; ``config.return_dict=False`` with and without a
criterion; per-token-mean with the batch's token count. The collectives of each micro-step are compared with the hand
loop's too. One process here, two processes in one launch (DDP and ZeRO 1/2/3)."""
import json

import pytest
import torch
from dist_helpers import REPO, run_ranks
from optional_packages import require_transformers

require_transformers("the Hugging Face rows train tiny GPT-2 and BERT models", module_level=True)

import hf_loop  # noqa: E402  (after the skip: it builds transformers models)

ONE_PROCESS = [(row, "fp32", "ddp", "trainer") for row in hf_loop.ROWS] + [
    ("own-loss", "fp32", "ddp", "engine"), ("own-loss", "bf16", "ddp", "trainer"), ("own-loss", "bf16", "ddp", "engine"),
    ("own-loss", "fp16", "ddp", "trainer"), ("own-loss", "fp16", "ddp", "engine"), ("token-mean", "fp16", "ddp", "trainer"),
    ("logits-criterion", "bf16", "ddp", "engine"), ("tuple-criterion", "fp32", "ddp", "engine"),
    ("token-mean", "bf16", "ddp", "trainer"), ("token-mean", "fp32", "ddp", "engine")]


def check(result: dict, case) -> None:
    assert "error" not in result, f"{case}: {result.get('trace')}"
    assert result["names"], case
    assert result["differ"] == {}, f"{case}: these tensors differ from the hand loop (max abs diff): {result['differ']}"
    assert result["lib_losses"] == result["hand_losses"], case
    assert len(result["lib_losses"]) == hf_loop.MICRO_BATCHES, case
    assert result["lib_collectives"] == result["hand_collectives"], \
        f"{case}: collectives per micro-step\n  hand {result['hand_collectives']}\n  lib  {result['lib_collectives']}"
    if "hand_metrics" in result:
        metrics, hand = result["metrics"], result["hand_metrics"]
        assert metrics["test/Accuracy"] == hand["test/Accuracy"], (case, metrics, hand)
        # the hook sums float32 losses weighted by batch size in float64, the hand check in float64
        assert metrics["test/Loss"] == pytest.approx(hand["test/Loss"], rel=1e-6), (case, metrics, hand)
        assert 0 <= metrics["train/Accuracy"] <= 1 and metrics["train/Loss"] > 0, metrics


@pytest.mark.slow
@pytest.mark.parametrize("case", ONE_PROCESS, ids="/".join)
def test_one_process_equals_the_hand_loop(launched, case):
    launched()
    torch.set_num_threads(1)
    results = hf_loop.run_all([case], 0)
    check(results["/".join(case)], case)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "result"
    run_ranks(REPO / "tests" / "hf_loop.py", [out], nproc=2, timeout=400)
    return [json.loads(out.with_name(f"result.rank{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", hf_loop.DISTRIBUTED_CASES, ids="/".join)
def test_two_processes_equal_the_hand_loop(two_ranks, case):
    for rank, results in enumerate(two_ranks):
        result = results["/".join(case)]
        check(result, (rank, *case))
    collectives = two_ranks[0]["/".join(case)]["lib_collectives"]
    if case[2] in ("ddp", "zero1"):  # DDP all-reduces its buckets only at each window's end: windows of 2, 2, 1
        assert [s.get("ddp_grad_bucket", 0) > 0 for s in collectives] == [False, True, False, True, True], collectives
    else:
        assert [s.get("reduce_scatter_single", 0) > 0 for s in collectives] == [False, True, False, True, True], \
            collectives
    expected = {"ddp": "torch DDP", "zero1": "ZeRO stage 1", "zero2": "ZeRO stage 2", "zero3": "ZeRO stage 3"}[case[2]]
    assert two_ranks[0]["/".join(case)]["strategy"].startswith(expected)
