"""The README's three code blocks run as written: the config file, the engine loop and the Trainer.

Only what the README leaves to the reader is defined here (a model, an optimizer, a criterion, a data set).
The snippets once used an undefined ``logger`` and an ``lr_scheduler`` that ``initialize`` returned as None.
"""
import re
import textwrap

from dist_helpers import REPO, run_python

PRELUDE = textwrap.dedent('''
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    train_set = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g))
''')


def readme_blocks():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _run(tmp_path, name, code):
    (tmp_path / name).write_text(PRELUDE + code + "\nprint('snippet ran:', engine.num_updates, 'updates')\n")
    proc = run_python(tmp_path / name, cwd=tmp_path, timeout=240)
    match = re.search(r"snippet ran: (\d+) updates", proc.stdout)
    assert match and int(match.group(1)) > 0, proc.stdout[-2000:]


def test_the_readme_snippets_run_as_written(tmp_path):
    engine_loop, trainer, config = readme_blocks()[:3]
    assert config.lstrip().startswith("# config.py")
    (tmp_path / "config.py").write_text(config)
    _run(tmp_path, "engine_loop.py", engine_loop)
    # the Trainer snippet is the other way to run the same script: after the same launch, with loaders
    launch = textwrap.dedent('''
        import colossal_lite
        from colossal_lite.utils import get_dataloader
        colossal_lite.launch_from_torch(config="config.py")
        train_loader = get_dataloader(train_set, shuffle=True, batch_size=32)
        test_loader = get_dataloader(train_set, batch_size=32)
    ''')
    _run(tmp_path, "trainer.py", launch + trainer)
    assert (tmp_path / "checkpoints" / "last").is_file()
