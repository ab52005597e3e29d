"""The speed report on 2 ranks (one launch): a big model with accumulation 1 is communication-bound, and the
report says so first; every rank records the same reduced figures, and only rank 0 prints the report."""
import json
import textwrap

from dist_helpers import run_ranks

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook, SpeedReportHook
    from colossal_lite.trainer.speed_report import rank_causes
    from colossal_lite.utils import get_dataloader

    out_dir = sys.argv[1]
    colossal_lite.launch_from_torch(config=dict(), verbose=False)
    rank = gpc.get_global_rank()
    torch.manual_seed(0)
    # a big embedding table and one sample per rank: each step's gradient all-reduce moves the whole table's
    # gradient (64 MiB) while the step computes almost nothing (with dense layers instead, the backward's own
    # memory traffic competes with the overlapped all-reduce on 2 cores, and a loaded machine could rank it first)
    model = nn.Sequential(nn.Embedding(262144, 64), nn.Flatten(), nn.Linear(64, 2))
    data = TensorDataset(torch.randint(0, 262144, (8, 1)), torch.randint(0, 2, (8,)))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                                    nn.CrossEntropyLoss(), get_dataloader(data, batch_size=1),
                                                    verbose=False)
    speed = SpeedReportHook()  # (the CPU's peak measured)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[speed, LossHook()], log_dir=False)
    causes = rank_causes(speed.figures)
    h = trainer.history
    result = dict(first=causes[0].key, suggestion=causes[0].suggestion, report=speed.report_text,
                  sps=h["train/samples_per_s"], per_rank=h["train/samples_per_s_per_rank"],
                  comm=h["train/time/communication"], world=speed.figures.world_size, steps=speed.figures.steps,
                  mfu=h["train/mfu"], peak=h["train/speed/peak_tflops"], mfu_fit=speed.figures.mfu)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
''')


def test_two_ranks_big_model_accumulation_1_is_named_communication_bound(tmp_path):
    script = tmp_path / "speed_two_ranks.py"
    script.write_text(SCRIPT)
    proc = run_ranks(script, [tmp_path], nproc=2, timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["first"] == "communication", ranks[0]["report"]
    assert "gradient_accumulation" in ranks[0]["suggestion"] and "ZeRO" in ranks[0]["suggestion"]
    # the figures are reduced over the ranks, the CPU's peak too (each process measures its own: MFU differed)
    for key in ("sps", "per_rank", "comm", "first", "mfu", "peak", "mfu_fit"):
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["world"] == 2 and ranks[0]["steps"] == 3  # (4 steps, the first one the warm-up)
    assert ranks[0]["sps"][0] == 2 * ranks[0]["per_rank"][0]
    assert proc.stdout.count("Speed report: 3 optimizer steps on 2 rank(s)") == 1  # rank 0 only


ZERO_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook, SpeedReportHook
    from colossal_lite.utils import get_dataloader
    from colossal_lite.utils.flops import count_step_flops

    out_dir, stage = sys.argv[1], int(sys.argv[2])
    colossal_lite.launch_from_torch(config=dict(zero=dict(stage=stage)), verbose=False)
    data = TensorDataset(torch.randn(32, 16, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 2)

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))

    def train(hooks):
        model = make_model()
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                                                        nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                        verbose=False)
        return Trainer(engine).fit(loader, epochs=2, hooks=[LossHook(), *hooks], log_dir=False)

    plain = train([])
    speed = SpeedReportHook(report=False)
    measured = train([speed])
    x, y = data[:4]  # the FLOPs of the model as written, unsharded, on one micro-batch of 4
    unsharded = count_step_flops(make_model(), x, y, nn.CrossEntropyLoss(), samples=4).flops
    result = dict(same=measured["train/Loss_step"] == plain["train/Loss_step"], steps=len(plain["train/Loss_step"]),
                  flops=speed.flops.flops, unsharded=unsharded, mfu=measured["train/mfu"],
                  sps=measured["train/samples_per_s"])
    with open(f"{out_dir}/rank{gpc.get_global_rank()}.json", "w") as f:
        json.dump(result, f)
''')


def test_zero_2_and_3_train_the_same_with_the_report_and_count_the_models_flops(tmp_path):
    """Counting the FLOPs runs the model on meta copies of its parameters. On a model sharded by FSDP2 that ran
    FSDP2's gathering hooks and left the live parameters in a state the next forward failed on (a Tensor/DTensor
    mix). A sharded model is counted at its full shapes with its hooks set aside: it trains as without the hook,
    bit for bit, and its FLOPs are the unsharded model's."""
    script = tmp_path / "speed_zero.py"
    script.write_text(ZERO_SCRIPT)
    for stage in (2, 3):
        run_ranks(script, [tmp_path, stage], nproc=2, timeout=180)
        for rank in (0, 1):
            result = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert result["same"] and result["steps"] == 8, (stage, result)  # every step's loss as without the hook
            assert result["flops"] == result["unsharded"] > 0, (stage, result)
            assert len(result["mfu"]) == 2 and result["mfu"][0] > 0 and result["sps"][0] > 0, (stage, result)
