"""MLflowTracker against a real local MLflow file store: params from the config, every record with its step,
the final checkpoint as artifacts, one run per training run, continued (not duplicated) by a resumed run."""
import subprocess
import sys

import pytest
import torch
from dist_helpers import run_ranks
from hook_helpers import crash_at
from torch import nn

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.history import is_measured
from colossal_lite.trainer.hooks import LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.trainer.trackers import MLflowTracker, RunInfo
from colossal_lite.utils import get_dataloader

mlflow = pytest.importorskip("mlflow")  # (in the dev extra; skipped only where the extra is not installed)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # recent MLflow asks for it to use a folder store
    colossal_lite.launch_from_torch(config=dict(clip_grad_norm=1.0, BATCH_SIZE=8, fp16=None), seed=3, verbose=False)
    yield (tmp_path / "mlruns").as_uri()
    gpc.destroy()


def build(data_seed=0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(data_seed)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return Engine(model, opt, nn.CrossEntropyLoss()), sched, get_dataloader(data, shuffle=True, seed=7, batch_size=8)


def fit(uri, folder, crash=None, resume=None, data_seed=0):
    engine, sched, loader = build(data_seed)
    trainer = Trainer(engine)
    hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), SaveCheckpointHook("4ba", folder)]
    history = trainer.fit(loader, epochs=2, hooks=hooks + ([crash_at(crash)] if crash else []), resume_from=resume,
                          trackers=[MLflowTracker(experiment="digits", tracking_uri=uri, run_name="mlp")])
    return trainer, history


def runs(uri):
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("digits")
    return client, client.search_runs([experiment.experiment_id])


def test_a_run_has_the_config_every_record_and_the_final_checkpoint(store, tmp_path):
    _, history = fit(store, tmp_path / "ck")
    client, (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlp"
    assert run.data.params["clip_grad_norm"] == "1.0" and run.data.params["BATCH_SIZE"] == "8"
    for name in history.names:
        logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        assert sorted(logged) == [(s, pytest.approx(v, rel=1e-12)) for s, v in history.series(name)], name
    files = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/epoch1-step10")}
    assert "checkpoints/epoch1-step10/meta.json" in files and len(files) >= 3


def test_a_resumed_run_continues_the_same_mlflow_run_without_sending_a_step_twice(store, tmp_path):
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(store, tmp_path / "ck", crash=7)  # checkpoint at step 4; the epoch end at step 5 was sent
    client, (crashed,) = runs(store)
    assert crashed.info.status == "FAILED"
    assert max(m.step for m in client.get_metric_history(crashed.info.run_id, "train/Loss_step")) == 5

    trainer, history = fit(store, tmp_path / "ck", resume="last")
    assert trainer.restored_from.name == "epoch0-step4"
    client, (run,) = runs(store)  # still one run
    assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
    for name in history.names:
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        if is_measured(name):
            # a save's seconds are recorded after its checkpoint is taken: the crashed process sent step 4's, and
            # the resumed history takes the same values back from the checkpoint's folder
            assert name.startswith("checkpoint/") and logged[0][0] == 4, name
        assert logged == [(s, pytest.approx(v, rel=1e-12)) for s, v in history.series(name)], name


def test_a_run_resumed_from_an_earlier_checkpoint_sends_its_own_values_after_it(store, tmp_path, capsys):
    """The whole run is sent, then resumed from step 4 on other data: MLflow cannot forget steps 5-10's first
    values, so each of those steps holds both, the later being the history's, and the user is told once."""
    fit(store, tmp_path / "ck")
    trainer, history = fit(store, tmp_path / "ck", resume=str(tmp_path / "ck" / "epoch0-step4"), data_seed=1)
    assert trainer.restored_from.name == "epoch0-step4"
    client, (run,) = runs(store)
    for name in history.names:
        latest = {}
        for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.timestamp):
            latest[m.step] = m.value
        assert sorted(latest.items()) == history.series(name), name
    logged = capsys.readouterr()
    assert (logged.out + logged.err).count("already holds other values from step 5 on") == 1


def test_a_nan_record_sent_before_is_not_taken_for_another_value(store, capsys):
    """A figure the run had not got is NaN (``NaN != NaN``): a resumed process replaying it sent it again and warned
    that the run held other values."""
    first = MLflowTracker(experiment="digits", tracking_uri=store)
    first.start(RunInfo(log_dir=None))
    first.log_metrics({"train/mfu": float("nan"), "train/Loss": 0.5}, step=3, epoch=0, time=1.0)
    first.finish("KILLED")
    resumed = MLflowTracker(experiment="digits", tracking_uri=store)
    resumed.load_state_dict(first.state_dict())
    resumed.start(RunInfo(log_dir=None))
    resumed.log_metrics({"train/mfu": float("nan"), "train/Loss": 0.5}, step=3, epoch=0, time=2.0)
    resumed.finish()
    client, (run,) = runs(store)
    for name in ("train/mfu", "train/Loss"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 1, name
    logged = capsys.readouterr()
    assert "already holds other values" not in logged.out + logged.err


def test_without_mlflow_the_error_names_the_extra(tmp_path):
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'mlflow' or name.startswith('mlflow.'):\n"
            "            raise ImportError('No module named ' + repr(name))\n"
            "sys.meta_path.insert(0, Block())\n"
            "from colossal_lite.trainer.trackers import MLflowTracker\n"
            "MLflowTracker()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "MLflowTracker needs the mlflow package, which is not installed: pip install 'colossal_lite[mlflow]'" \
        in proc.stderr, proc.stderr[-2000:]


def test_the_default_store_works_after_the_dev_install(tmp_path, monkeypatch):
    """``MLflowTracker(experiment=...)`` with no tracking_uri: MLflow's default, a SQLite file in the working
    folder, which the dev extra's client opens."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    colossal_lite.launch_from_torch(config=dict(BATCH_SIZE=8), seed=3, verbose=False)
    try:
        engine, _, loader = build()
        tracker = MLflowTracker(experiment="exp1", log_checkpoint=False)
        Trainer(engine).fit(loader, epochs=1, hooks=[LossHook()], trackers=[tracker])
    finally:
        gpc.destroy()
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and "train/Loss" in run.data.metrics


def test_a_store_mlflow_cannot_open_gets_an_error_naming_what_to_install_or_set(tmp_path):
    """Only the client (mlflow-skinny, no SQLAlchemy): MLflow's own error named neither the extra nor a setting."""
    # SQLAlchemy as a broken install: found, but importing it fails (what the store then needs)
    code = ("import importlib.machinery, sys\n"
            "class Broken:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'sqlalchemy' or name.startswith('sqlalchemy.'):\n"
            "            return importlib.machinery.ModuleSpec(name, self)\n"
            "    def create_module(self, spec):\n"
            "        return None\n"
            "    def exec_module(self, module):\n"
            "        raise ImportError('No module named ' + repr(module.__name__))\n"
            "sys.meta_path.insert(0, Broken())\n"
            "from colossal_lite.trainer.trackers import MLflowTracker, RunInfo\n"
            "MLflowTracker(experiment='exp1').start(RunInfo(log_dir=None))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)
    assert proc.returncode != 0
    assert "MLflowTracker cannot use the tracking store MLflow's default" in proc.stderr, proc.stderr[-2000:]
    assert "pip install 'colossal_lite[mlflow]'" in proc.stderr and "pip install sqlalchemy alembic" in proc.stderr
    assert "tracking_uri=" in proc.stderr


TWO_RANKS = '''
import json, sys
import torch
from torch import nn
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook
from colossal_lite.trainer.trackers import MLflowTracker
from colossal_lite.utils import get_dataloader

colossal_lite.launch_from_torch(config=dict(BATCH_SIZE=4), seed=1, verbose=False)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                verbose=False)
tracker = MLflowTracker(experiment="two", tracking_uri=sys.argv[1])
history = Trainer(engine).fit(loader, epochs=2, hooks=[LossHook(), SaveCheckpointHook(1, sys.argv[2])],
                              trackers=[tracker])
line = json.dumps({"rank": gpc.get_global_rank(), "run_id": tracker.run_id, "history": history.without_time()})
print(line + "\\n", end="", flush=True)
gpc.destroy()
'''


def test_two_ranks_make_one_mlflow_run_that_every_rank_knows(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    script = tmp_path / "run.py"
    script.write_text(TWO_RANKS)
    uri = (tmp_path / "mlruns").as_uri()
    proc = run_ranks(script, [uri, tmp_path / "ck"], timeout=180)
    ranks = {r["rank"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert sorted(ranks) == [0, 1] and ranks[0]["run_id"] == ranks[1]["run_id"] is not None
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("two").experiment_id])
    assert run.info.run_id == ranks[0]["run_id"] and run.info.status == "FINISHED"
    logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/Loss_step"))
    assert logged == [(s, v) for s, _, name, v in ranks[0]["history"] if name == "train/Loss_step"]
    assert len(logged) == 8
