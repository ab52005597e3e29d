"""pytorch/examples' DCGAN update through two engines equals the original bit for bit (issue 28, item 2):
two backward calls before the discriminator's step are one micro-batch, as legacy Colossal-AI counted them."""
import json
from pathlib import Path

import dcgan_loop
import pytest
from dist_helpers import run_ranks

TESTS = Path(__file__).parents[1]


def _assert_same(result, where):
    assert result["differ"] == {}, f"{where}: tensors differ from the original loop: {result['differ']}"
    assert result["lib_losses"] == result["hand_losses"], f"{where}: Loss_D / Loss_G differ"
    assert len(result["lib_losses"]) == dcgan_loop.STEPS


def test_dcgan_update_equals_the_original_in_one_process(launched):
    launched({})
    _assert_same(dcgan_loop.differences(rank=0, world=1), "1 process")


@pytest.mark.timeout(240)
def test_dcgan_update_equals_the_original_with_ddp_on_two_ranks(tmp_path):
    run_ranks(TESTS / "dcgan_loop.py", [tmp_path / "result"], nproc=2, timeout=180)
    for rank in (0, 1):
        _assert_same(json.loads((tmp_path / f"result.rank{rank}").read_text()), f"rank {rank}")
