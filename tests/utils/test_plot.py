"""``colossal-lite plot`` and ``plot_metrics``: the picture a run's metrics file makes (its size, that it is not
blank, one line per metric in each panel), jsonl and csv input, the errors a user reads, and the error when
the plot extra is missing."""
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dist_helpers import doc_python_blocks, run_python
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from colossal_lite.cli import main
from colossal_lite.utils.metrics_file import MetricsFileError, read_metrics
from colossal_lite.utils.plot import PlotError, metric_group, plot_metrics

REPO = Path(__file__).resolve().parents[2]
START = 1764071234.5  # wall clock of the made-up run's first step, seconds since the epoch
GROUPS = {"Loss": ["train/Loss_step", "train/Loss", "test/Loss"],
          "Accuracy": ["train/Accuracy_step", "train/Accuracy", "test/Accuracy"],
          "Throughput": ["train/Throughput"], "LR": ["lr"]}


def made_up_run(epochs=3, steps_per_epoch=10):
    """Records as the Trainer writes them: per-step train loss, accuracy and LR, epoch values at each epoch's last
    step, an evaluation after each epoch, and a user's metric."""
    records = []

    def add(step, epoch, name, value):
        records.append(dict(step=step, epoch=epoch, name=name, value=value, time=START + 0.25 * step))

    for epoch in range(epochs):
        for i in range(steps_per_epoch):
            step = epoch * steps_per_epoch + i + 1
            loss = 2.3 * math.exp(-step / 12) + 0.05 * math.sin(step)
            add(step, epoch, "train/Loss_step", loss)
            add(step, epoch, "train/Accuracy_step", 0.9 - loss / 3)
            add(step, epoch, "lr", 0.1 * 0.5 * (1 + math.cos(math.pi * step / (epochs * steps_per_epoch))))
        add(step, epoch, "train/Loss", loss + 0.1)
        add(step, epoch, "train/Accuracy", 0.88 - loss / 3)
        add(step, epoch, "train/Throughput", 1200.0 + 10 * epoch)
        add(step, epoch, "test/Loss", loss + 0.2)
        add(step, epoch, "test/Accuracy", 0.85 - loss / 3)
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_csv(path, records):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "epoch", "name", "value", "time"])
        writer.writeheader()
        writer.writerows(records)
    return path


def lines_by_panel(fig):
    return {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes}


def pixels_near(image, colour, tolerance=0.06):
    """How many pixels of an RGB(A) float image are within ``tolerance`` of ``colour`` in every channel."""
    return int((np.abs(image[..., :3] - np.array(to_rgb(colour))) < tolerance).all(axis=-1).sum())


def test_the_cli_draws_a_png_of_the_size_asked_with_train_and_test_curves(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", made_up_run())
    out = tmp_path / "curves.png"
    assert main(["plot", str(run), "-o", str(out), "--size", "8,5", "--dpi", "80"]) == 0
    assert capsys.readouterr().out == f"wrote {out}: Loss (3), Accuracy (3), Throughput (1), LR (1)\n"
    image = imread(out)
    assert image.shape[:2] == (5 * 80, 8 * 80)
    assert image[..., :3].std() > 0.05
    assert len(np.unique((image[..., :3] * 255).round().reshape(-1, 3), axis=0)) > 100
    # Train curves in the first colour of matplotlib's cycle, test in the second, LR in the third.
    assert pixels_near(image, "C0") > 400 and pixels_near(image, "C1") > 200 and pixels_near(image, "C2") > 80


def test_the_default_size_follows_the_panels(tmp_path):
    out = tmp_path / "two.png"
    fig = plot_metrics(made_up_run(), out, metrics="Loss,LR")
    assert [ax.get_title() for ax in fig.axes] == ["Loss", "LR"]
    width, height = fig.get_size_inches()
    assert imread(out).shape[:2] == (round(height * 100), round(width * 100))
    one = plot_metrics(made_up_run(), tmp_path / "one.png", metrics=["lr"], dpi=40)
    assert imread(tmp_path / "one.png").shape[:2] == tuple(round(x * 40) for x in one.get_size_inches()[::-1])
    assert one.get_size_inches()[0] < width


def test_one_line_per_metric_name_in_each_panel_with_the_files_values(tmp_path):
    records = made_up_run()
    fig = plot_metrics(write_jsonl(tmp_path / "metrics.jsonl", records))
    assert lines_by_panel(fig) == GROUPS
    assert fig.get_suptitle() == str(tmp_path / "metrics.jsonl")
    loss_step = fig.axes[0].get_lines()[0]
    expected = [(r["step"], r["value"]) for r in records if r["name"] == "train/Loss_step"]
    assert list(zip(loss_step.get_xdata(), loss_step.get_ydata())) == expected
    test_loss = fig.axes[0].get_lines()[2]
    assert list(test_loss.get_xdata()) == [10, 20, 30] and test_loss.get_marker() == "s"
    assert fig.axes[0].get_lines()[1].get_marker() == "o"
    assert {line.get_color() for line in fig.axes[0].get_lines()[:2]} == {"C0"}


def test_group_names():
    assert [metric_group(n) for n in ("train/Loss_step", "train/Loss", "test/Loss", "lr", "val/top5",
                                      "train/_step", "Perplexity")] == \
           ["Loss", "Loss", "Loss", "LR", "top5", "_step", "Perplexity"]


def test_csv_gives_the_same_figure_and_a_folder_prefers_jsonl(tmp_path):
    records = made_up_run()
    write_csv(tmp_path / "metrics.csv", records)
    from_csv = plot_metrics(tmp_path)
    assert lines_by_panel(from_csv) == GROUPS
    assert read_metrics(tmp_path / "metrics.csv") == records
    write_jsonl(tmp_path / "metrics.jsonl", [r for r in records if r["name"] == "lr"])
    assert lines_by_panel(plot_metrics(tmp_path)) == {"LR": ["lr"]}


def test_choosing_panels_their_order_and_a_log_scale(tmp_path):
    fig = plot_metrics(made_up_run(), metrics=" lr, loss ", log_y="Loss", title="run 7")
    assert [ax.get_title() for ax in fig.axes] == ["LR", "Loss"]
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log"]
    assert fig.get_suptitle() == "run 7"
    with pytest.raises(PlotError, match=r"no metric 'Acc' in the records given; the metrics there are "
                                        r"Loss, Accuracy, Throughput, LR"):
        plot_metrics(made_up_run(), metrics="Loss,Acc")
    with pytest.raises(PlotError, match=r"^no records in the records given: nothing to plot$"):
        plot_metrics(iter([]))


def test_a_resumed_run_keeps_the_later_record_of_a_step_and_a_half_written_last_line_is_left_out(tmp_path):
    first = made_up_run(epochs=2)
    rerun = [dict(r, value=r["value"] + 1) for r in first if r["step"] > 10]  # resumed from step 10's checkpoint
    path = write_jsonl(tmp_path / "metrics.jsonl", first + rerun)
    with open(path, "a") as f:
        f.write('{"step": 21, "epoch": 2, "name": "train/Loss_st')  # the run is writing this line now
    fig = plot_metrics(path)
    line = fig.axes[0].get_lines()[0]
    steps, values = list(line.get_xdata()), list(line.get_ydata())
    assert steps == list(range(1, 21))
    before = [r["value"] for r in first if r["name"] == "train/Loss_step"]
    assert values == before[:10] + [v + 1 for v in before[10:]]


def test_non_finite_values_are_gaps(tmp_path):
    records = [dict(step=s, name="train/Loss_step", value=v) for s, v in enumerate([1.0, float("nan"), 0.5,
                                                                                    float("inf"), 0.25], 1)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "name": "lr", "value": null}\n')
    fig = plot_metrics(path, tmp_path / "gaps.png")
    ys = fig.axes[0].get_lines()[0].get_ydata()
    assert np.isnan(ys[[1, 3]]).all() and list(ys[[0, 2, 4]]) == [1.0, 0.5, 0.25]
    assert read_metrics(path)[-1]["epoch"] is None and math.isnan(read_metrics(path)[-1]["value"])


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_the_suffix_picks_the_format(tmp_path, suffix, magic):
    plot_metrics(made_up_run(), tmp_path / f"curves{suffix}")
    assert (tmp_path / f"curves{suffix}").read_bytes().startswith(magic)


def test_bad_outputs_are_refused_before_reading(tmp_path):
    with pytest.raises(PlotError, match=r"curves\.jpg: the file's suffix picks the format; use one of "
                                        r"\.png, \.svg, \.pdf"):
        plot_metrics(tmp_path / "missing", tmp_path / "curves.jpg")
    with pytest.raises(PlotError, match=r"the folder .*nowhere does not exist; create it first"):
        plot_metrics(made_up_run(), tmp_path / "nowhere" / "curves.png")


def test_missing_empty_and_malformed_inputs_are_named(tmp_path):
    with pytest.raises(MetricsFileError, match=rf"^no metrics.jsonl or metrics.csv in {tmp_path}: give the run "
                                               "folder"):
        read_metrics(tmp_path)
    with pytest.raises(MetricsFileError, match=r"^no such file or folder: .*gone"):
        read_metrics(tmp_path / "gone")
    (tmp_path / "log.txt").write_text("x")
    with pytest.raises(MetricsFileError, match=r"log.txt: expected a metrics .jsonl or .csv file"):
        read_metrics(tmp_path / "log.txt")
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl holds no metrics records yet"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "name": "lr", "value": 0.1}\n{"step": 2, name\n'
                                            '{"step": 3, "name": "lr", "value": 0.1}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not a JSON object \(.*\): \{\"step\": 2, name$"):
        read_metrics(tmp_path)
    bad = {'[1, 2]': "expected a JSON object like", '{"step": 1, "value": 0.1}': "the record has no 'name'",
           '{"step": 1.5, "name": "lr", "value": 0.1}': "'step' should be a whole number, got 1.5",
           '{"step": 1, "name": "lr", "value": "high"}': "'value' should be a number, got 'high'",
           '{"step": 1, "name": 3, "value": 0.1}': "'name' should be a metric name"}
    for line, message in bad.items():
        (tmp_path / "metrics.jsonl").write_text(line + "\n")
        with pytest.raises(MetricsFileError, match=rf"metrics.jsonl:1: {message}"):
            read_metrics(tmp_path)


def test_malformed_csv_is_named(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,metric,value\n1,0,lr,0.1\n")
    with pytest.raises(MetricsFileError, match=r"metrics.csv:1: the header lacks column\(s\) name: expected "
                                               r"step,epoch,name,value,time, got step,epoch,metric,value"):
        read_metrics(path)
    path.write_text("step,epoch,name,value,time\n1,0,lr,0.1,5\n2,0,lr,fast,6\n")
    with pytest.raises(MetricsFileError, match=r"metrics.csv:3: 'value' should be a number, got 'fast'"):
        read_metrics(path)
    path.write_text("step,epoch,name,value,time\n1,0,lr,0.1\n")
    with pytest.raises(MetricsFileError, match=r"metrics.csv:2: 4 fields where the header has 5"):
        read_metrics(path)
    path.write_text("step,epoch,name,value,time\n")
    with pytest.raises(MetricsFileError, match=r"metrics.csv holds no metrics records yet"):
        read_metrics(path)


def test_an_unfinished_last_csv_row_is_left_out_and_a_binary_file_is_named(tmp_path):
    """As for .jsonl (plot.md: a running job can be plotted): the CSV reader failed on the cut row, or took a row
    cut inside its last field as whole; a file that is not text gave a UnicodeDecodeError traceback (a probe)."""
    path = tmp_path / "metrics.csv"
    whole = "step,epoch,name,value,time\n1,0,lr,0.1,5\n2,0,lr,0.2,6\n"
    for cut in ("3,0,lr", "3,0,lr,0.3,17"):
        path.write_text(whole + cut)
        assert [r["value"] for r in read_metrics(path)] == [0.1, 0.2], cut
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(MetricsFileError, match=r"metrics.csv is not a metrics file: it is not UTF-8 text"):
        read_metrics(path)


@pytest.mark.parametrize("args, message", [(["--dpi", "0"], "pixels per inch are above 0 and at most 2000, got '0'"),
                                           (["--dpi", "x"], "expected pixels per inch such as 100; got 'x'")])
def test_a_bad_dpi_is_refused_by_the_parser(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as stop:
        main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png"), *args])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_picture_too_large_or_unwritable_is_one_line_and_exit_1(tmp_path, capsys):
    write_jsonl(tmp_path / "metrics.jsonl", made_up_run())
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png"), "--size", "1e6,1e6"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Image size of ") and "Traceback" not in err, err
    (tmp_path / "taken.png").mkdir()  # (as root no folder is read-only: a folder of the picture's name fails too)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "taken.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Is a directory" in err and "Traceback" not in err, err


def test_the_cli_prints_the_error_without_a_traceback(tmp_path, capsys):
    status = main(["plot", str(tmp_path), "-o", str(tmp_path / "curves.png")])
    printed = capsys.readouterr()
    assert status == 1 and printed.out == ""
    assert printed.err == (f"error: no metrics.jsonl or metrics.csv in {tmp_path}: give the run folder the Trainer "
                           "wrote them to (a checkpoint folder or log_dir), or the path of a .jsonl or .csv file\n")
    assert not (tmp_path / "curves.png").exists()


BLOCK_MATPLOTLIB = """\
import sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoMatplotlib())
import colossal_lite.cli
assert colossal_lite.cli.main(["check", sys.argv[3]]) == 0
assert colossal_lite.cli.main(["info"]) == 0
sys.exit(colossal_lite.cli.main(["plot", sys.argv[1], "-o", sys.argv[2]]))
"""


def test_without_matplotlib_the_error_names_the_extra_and_other_commands_work(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", made_up_run())
    config = tmp_path / "config.py"
    config.write_text("BATCH_SIZE = 8\n")
    proc = subprocess.run([sys.executable, "-c", BLOCK_MATPLOTLIB, str(tmp_path), str(tmp_path / "c.png"),
                           str(config)], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("error: plotting metrics needs matplotlib (No module named 'matplotlib'): "
                           "pip install 'colossal_lite[plot]'\n")
    assert not (tmp_path / "c.png").exists()
    assert "\nplot extra: not installed (pip install 'colossal_lite[plot]')\n" in proc.stdout
    assert f"{config}: OK" in proc.stdout


def test_info_says_the_plot_extra_is_installed(capsys):
    assert main(["info"]) == 0
    assert "\nplot extra: installed\n" in capsys.readouterr().out


def test_importing_the_cli_and_the_plot_module_does_not_load_matplotlib():
    probe = ("import sys, colossal_lite, colossal_lite.cli, colossal_lite.utils.plot\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'PIL')))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n", proc.stdout


def test_the_docs_snippet_writes_a_metrics_file_and_plots_it(tmp_path):
    blocks = doc_python_blocks("docs/plot.md")
    assert len(blocks) == 1
    script = tmp_path / "plot_demo.py"
    script.write_text(blocks[0])
    out = run_python(script, timeout=180, cwd=tmp_path).stdout
    assert out == ("69 records\nLoss ['train/Loss_step', 'train/Loss', 'test/Loss']\nAccuracy ['test/Accuracy']\n"
                   "LR ['lr']\n")
    assert imread(tmp_path / "curves.png").shape[:2] == (500, 800)
    page = (REPO / "docs" / "plot.md").read_text()
    assert out in page, "the page's 'prints' block should be what the snippet prints"


@pytest.mark.parametrize("size, message", [("big", "expected WIDTH,HEIGHT in inches such as 11,7; got 'big'"),
                                           ("8,0", "a size is positive inches, got '8,0'")])
def test_a_bad_size_is_refused_by_the_parser(tmp_path, capsys, size, message):
    with pytest.raises(SystemExit) as stop:
        main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png"), "--size", size])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_size_with_an_x_works(tmp_path, capsys):
    write_jsonl(tmp_path / "metrics.jsonl", made_up_run())
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png"), "--size", "4x3", "--dpi", "30"]) == 0
    assert imread(tmp_path / "c.png").shape[:2] == (90, 120)
