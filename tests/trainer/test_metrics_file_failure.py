"""The metrics file failing mid-run (issue 29, item 7): training and checkpoints go on, the file stops with a
warning, and a resumed run rewrites it in full. The failure is real: the process's file-size limit
(RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past it fails with EFBIG as on a full quota) stops the growing
metrics file while the checkpoints, each written anew and smaller than the limit, still fit."""
import json
import textwrap

from dist_helpers import run_python

SCRIPT = textwrap.dedent("""
    import json, resource, signal, sys, warnings
    import torch
    from torch import nn
    import colossal_lite
    from colossal_lite.checkpoint import CheckpointManager
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook

    folder, limit = sys.argv[1], int(sys.argv[2])
    colossal_lite.launch_from_torch(config={}, seed=0, verbose=False)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, generator=g), torch.randint(0, 2, (2,), generator=g)) for _ in range(300)]

    def trainer():
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                        nn.CrossEntropyLoss(), batches, verbose=False)
        return Trainer(engine), loader

    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    t, loader = trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = t.fit(loader, epochs=1, hooks=[LossHook(), SaveCheckpointHook("100ba", folder)])
    said = [str(w.message) for w in caught if "MetricsFile" in str(w.message)]
    shared, _ = CheckpointManager(folder).load("last")
    print(json.dumps(dict(step=t.state.step, steps=len(history.series("train/Loss_step")), warnings=said,
                          last=shared["trainer"]["progress"]["step"])))
    gpc.destroy()
""")


def test_a_metrics_file_that_cannot_grow_stops_with_a_warning_and_training_goes_on(tmp_path):
    script = tmp_path / "grow.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "run"
    limit = 32 * 1024  # the checkpoint files of this run stay below it (25 KiB at most); the metrics file passes it
    # near step 170
    out = json.loads(run_python(script, [folder, limit], timeout=180).stdout.splitlines()[-1])
    assert out["step"] == 300 and out["steps"] == 300  # every step trained and in the history
    assert out["last"] == 300  # every checkpoint was written, the last one included
    (warning,) = out["warnings"]
    assert warning.startswith(f"MetricsFile: writing {folder / 'metrics.jsonl'} failed at step ")
    assert "File too large" in warning and "training goes on" in warning
    written = (folder / "metrics.jsonl").read_text().splitlines()
    assert 0 < len(written) < 2 * 300 and (folder / "metrics.jsonl").stat().st_size <= limit

    # resumed without the limit (a disk with room again): the file is rewritten from the history, every step once
    script.write_text(SCRIPT.replace("epochs=1", "epochs=2, resume_from='auto'"))
    out = json.loads(run_python(script, [folder, 0], timeout=180).stdout.splitlines()[-1])
    assert out["step"] == 600 and out["warnings"] == []
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    loss_steps = [r["step"] for r in records if r["name"] == "train/Loss_step"]
    assert loss_steps == list(range(1, 601))
