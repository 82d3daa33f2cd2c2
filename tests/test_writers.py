"""The writers: the console line, the JSON lines file and TensorBoard's event files, read back."""

from __future__ import annotations

import json
import logging
import math
import pickle
import sys

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Metrics, testing, writers
from fnloop.writers import Line, format_line


def metrics(*rows: dict) -> Metrics:
    m = Metrics(window=5)
    for i, row in enumerate(rows):
        m = m.record(i, row)
    return m


# -- the console line ----------------------------------------------------------------------------------


def test_console_line_reads_as_detectron2s():
    m = metrics(
        {"loss": 4.0, "loss_cls": 1.0, "lr": 0.02, "time": 0.5, "data_time": 0.1},
        {"loss": 2.0, "loss_cls": 3.0, "lr": 0.01, "time": 0.3, "data_time": 0.3, "acc": 0.75},
        {"loss": 1.0, "loss_cls": 2.0, "lr": 0.005, "time": 0.4, "data_time": 0.2, "max_mem": 812.4},
    )
    line = Line(3, 103, m, ("loss", "loss_cls", "lr", "time", "data_time", "acc", "max_mem"))
    assert format_line(line) == (
        "eta: 0:00:40  iter: 3  loss: 2  loss_cls: 2  acc: 0.75  lr: 5.000e-03  "
        "time: 0.4000  data_time: 0.2000  max_mem: 812M"
    )


def test_console_line_of_a_finished_run_shows_a_zero_eta():
    m = metrics({"loss": 1.0, "time": 0.5})
    assert format_line(Line(50, 50, m, ("loss",))).startswith("eta: 0:00:00  iter: 50  loss: 1")


def test_console_line_without_time_has_no_eta():
    m = metrics({"loss": torch.tensor(0.25)})
    assert format_line(Line(1, 10, m, ("loss",))) == "iter: 1  loss: 0.25"


def test_console_logs_to_the_fnloop_logger_at_info(caplog):
    caplog.set_level(logging.INFO, logger="fnloop")
    line = Line(1, 10, metrics({"loss": 1.0}), ("loss",))
    writers.console().write(line)
    writers.console().write(Line(1, 10, line.metrics, ("loss",), resumed=True))
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("fnloop", logging.INFO, "iter: 1  loss: 1")
    ]


def test_console_is_seen_where_logging_is_not_configured(monkeypatch, capsys):
    logger = logging.getLogger("fnloop")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logger, "handlers", [])
    level = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        writers.console().write(Line(1, 10, metrics({"loss": 1.0}), ("loss",)))
        writers.console().write(Line(2, 10, metrics({"loss": 1.0}), ("loss",)))
        assert len(logger.handlers) == 1
    finally:
        logger.setLevel(level)
    err = capsys.readouterr().err.splitlines()
    assert [text.split("] ", 1)[1] for text in err] == ["iter: 1  loss: 1", "iter: 2  loss: 1"]


def test_console_leaves_configured_logging_alone(monkeypatch):
    logger = logging.getLogger("fnloop")
    monkeypatch.setattr(logger, "handlers", [logging.NullHandler()])
    writers.console().write(Line(1, 10, metrics({"loss": 1.0}), ("loss",)))
    assert len(logger.handlers) == 1


# -- JSON lines ----------------------------------------------------------------------------------------


def test_jsonl_appends_one_parsable_object_per_line(tmp_path):
    path = tmp_path / "deep" / "metrics.jsonl"
    out = writers.jsonl(path)
    m = metrics({"loss": torch.tensor(0.5), "lr": 0.1}, {"loss": 0.25})
    out.write(Line(1, 9, m, ("loss", "lr")))
    out.write(Line(2, 9, m, ("loss",)))
    out.close()
    rows = [json.loads(text) for text in path.read_text().splitlines()]
    assert rows == [{"iteration": 1, "loss": 0.25, "lr": 0.1}, {"iteration": 2, "loss": 0.25}]
    assert all(type(v) is float for row in rows for k, v in row.items() if k != "iteration")


def test_jsonl_start_cuts_back_to_earlier_iterations_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"iteration": i, "loss": 1.0}) + "\n" for i in (2, 4, 6, 8)) + '{"itera'
    )
    writers.jsonl(path).start(6)
    assert [json.loads(t)["iteration"] for t in path.read_text().splitlines()] == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left


def test_jsonl_start_leaves_an_intact_file_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 2}\n')
    before = path.stat().st_mtime_ns, path.stat().st_ino
    writers.jsonl(path).start(3)
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    writers.jsonl(tmp_path / "missing.jsonl").start(3)
    assert not (tmp_path / "missing.jsonl").exists()


def test_jsonl_refuses_a_non_path():
    with pytest.raises(TypeError, match=r"'path' must be a str or os.PathLike \(got 3 that is an int\)"):
        writers.jsonl(3)


# -- TensorBoard -------------------------------------------------------------------------------------


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_event_files_tensorboard_reads(tmp_path):
    out = writers.tensorboard(tmp_path)
    out.start(0)
    out.write(Line(20, 50, metrics({"loss": torch.tensor(0.5), "lr": 0.125}), ("loss", "lr")))
    out.write(Line(40, 50, metrics({"loss": 0.25}), ("loss",)))
    out.close()
    assert scalars(tmp_path) == {"loss": [(20, 0.5), (40, 0.25)], "lr": [(20, 0.125)]}


def test_tensorboard_start_purges_the_events_of_a_crashed_run_past_the_resume(tmp_path):
    out = writers.tensorboard(tmp_path)
    out.start(0)
    for i in (10, 20, 30):
        out.write(Line(i, 50, metrics({"loss": float(i)}), ("loss",)))
    out.close()
    out.start(20)  # resumed at 20: what the first run wrote at 20 and 30 is gone
    out.write(Line(30, 50, metrics({"loss": -30.0}), ("loss",)))
    out.close()
    assert scalars(tmp_path) == {"loss": [(10, 10.0), (30, -30.0)]}


def test_tensorboard_missing_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(
        ImportError,
        match=r'pip install tensorboard \(from a checkout of fnloop: pip install -e "\.\[tensorboard\]"\)',
    ):
        writers.tensorboard(tmp_path)


def test_writers_pickle_and_compare_by_configuration(tmp_path):
    for made in (writers.console(), writers.jsonl(tmp_path / "m.jsonl"), writers.tensorboard(tmp_path)):
        assert pickle.loads(pickle.dumps(made)) == made
        assert isinstance(made, writers.Writer)


# -- no host sync where nothing is written -------------------------------------------------------------


def test_values_are_converted_only_when_a_line_is_written(monkeypatch, tmp_path):
    calls: list[int] = []
    convert = fl._core.metrics.to_floats

    def counting(values):
        calls.append(1)
        return convert(values)

    # Every module that converts: the line (all writers read it), the console, the metrics.
    monkeypatch.setattr(writers._line, "to_floats", counting)
    monkeypatch.setattr(writers._console, "to_floats", counting)
    monkeypatch.setattr(fl._core.metrics, "to_floats", counting)
    step = lambda s, b: fl.record(s, loss=torch.tensor(float(b)), acc=torch.tensor(0.5))  # noqa: E731
    hooks = [fl.every(10, fl.hooks.log(writers.jsonl(tmp_path / "m.jsonl"), writers.tensorboard(tmp_path)))]
    seen = []
    for state in fl.scan(fl.TrainState(max_iter=25), step, range(25), hooks):
        seen.append((state.iteration, len(calls)))
    # Each write converts once, for both writers: after steps 10 and 20, and at the end (25).
    assert [n for _, n in seen] == [0] * 9 + [1] * 10 + [2] * 5 + [2, 3]
    assert [json.loads(t)["iteration"] for t in (tmp_path / "m.jsonl").read_text().splitlines()] == [
        10,
        20,
        25,
    ]


def test_a_loss_recorded_once_per_period_shows_its_own_value_not_a_median_with_older_ones():
    m = metrics({"loss": 4.0, "val_loss": 0.9})  # an evaluation at the first period
    for i in range(1, 6):
        m = m.record(i, {"loss": float(4 - i)})
    m = m.record(5, {"val_loss": 0.1})
    # Written at 6, the previous write at 3: training losses 1, 0, -1 and one validation loss since
    # (over the whole window they would be 1 and 0.5).
    text = format_line(Line(6, 10, m, ("loss", "val_loss"), first=3))
    assert "  loss: 0  " in text and text.endswith("val_loss: 0.1")


def test_every_metric_but_lr_peak_and_counts_is_a_median_since_the_previous_write():
    m = Metrics(window=10)
    for i, acc in enumerate([0.0, 0.0, 1.0, 0.5, 1.0]):
        m = m.record(i, {"accuracy": acc, "lr": 0.1 * (i + 1), "skipped": i, "max_mem": 100.0 + i})
    text = format_line(Line(5, 10, m, ("accuracy", "lr", "skipped", "max_mem"), first=2))
    assert "accuracy: 1  " in text  # median of 1.0, 0.5, 1.0, not the newest value alone
    assert "lr: 5.000e-01" in text and "skipped: 4" in text and text.endswith("max_mem: 104M")


@pytest.mark.parametrize("make", [fl.writers.jsonl, fl.writers.tensorboard])
def test_an_empty_path_is_refused_when_the_writer_is_built(make):
    # jsonl('') failed only at its first write (IsADirectoryError: '.'); tensorboard('') made a new
    # ./runs/<date> directory per run, where purge_step never applies.
    with pytest.raises(ValueError, match=r"is empty"):
        make("")


def test_two_jsonl_writers_on_one_path_in_one_log_are_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"two writers, .* write to .*m.jsonl: every line would be written twice"
    ):
        fl.hooks.log(fl.writers.jsonl(tmp_path / "m.jsonl"), fl.writers.jsonl(str(tmp_path / "m.jsonl")))


@pytest.mark.parametrize("make", [fl.writers.jsonl, fl.writers.tensorboard])
def test_two_log_hooks_of_one_run_on_one_path_are_refused_and_leave_nothing_held(tmp_path, make):
    # Two log hooks (two names) on one file duplicated every line; claims counted per process let
    # them through. The run is refused before its first step, and a run after it may use the path.
    from fnloop._atomic import holds

    path = tmp_path / "m"
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    hooks = [fl.hooks.log(make(path), name="a"), fl.hooks.log(make(path), name="b")]
    with pytest.raises(fl.hooks.DirectoryInUse, match=r"another log hook of this process") as caught:
        fl.run(fl.TrainState(max_iter=3), step, [None] * 3, hooks)
    assert caught.value.state.iteration == 0  # refused before the first step
    assert not holds(path)
    if make is fl.writers.jsonl:
        assert not path.exists()  # the refused run wrote no line
    final = fl.run(fl.TrainState(max_iter=3), step, [None] * 3, [fl.hooks.log(make(path), name="b")])
    assert final.iteration == 3 and not holds(path)
    if make is fl.writers.jsonl:
        assert [json.loads(t)["iteration"] for t in path.read_text().splitlines()] == [1, 2, 3]


def test_a_finished_run_continued_by_the_same_log_hook_keeps_every_line(tmp_path):
    # The log's own claims at every write nest under its BEFORE_TRAIN one. Continued from a finished
    # state, the log once lost two lines (2 and 3): the end cut the line at 2 back without the
    # metrics to write it again, and counted the next run's first step as written.
    path = tmp_path / "m.jsonl"
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    hook = fl.hooks.log(fl.writers.jsonl(path))
    half = fl.run(fl.TrainState(max_iter=2), step, [None] * 2, [hook])
    fl.run(attrs.evolve(half, max_iter=4), step, [None] * 2, [hook])
    assert [json.loads(t)["iteration"] for t in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_json_lines_stay_strict_json_with_non_finite_values_readable(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = fl.writers.jsonl(path)
    metrics = Metrics().record(0, {"a": float("nan"), "b": float("inf"), "c": -float("inf"), "d": 1.5})
    writer.write(Line(1, 2, metrics, ("a", "b", "c", "d")))
    writer.close()

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    entry = json.loads(path.read_text(), parse_constant=refuse)
    assert entry["b"] == "Infinity" and entry["c"] == "-Infinity" and entry["d"] == 1.5
    assert math.isnan(float(entry["a"])) and float(entry["b"]) == math.inf


# -- CSV -----------------------------------------------------------------------------------------------


def _rows(path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def _with_late_metric(state, batch):
    state = fl.record(state, loss=float(state.iteration))
    return fl.record(state, val=float(-state.iteration)) if state.iteration % 3 == 2 else state


def test_csv_writes_a_row_per_write_and_a_column_per_metric_as_it_appears(tmp_path):
    path = tmp_path / "m.csv"
    fl.run(
        fl.TrainState(max_iter=6),
        _with_late_metric,
        [None] * 6,
        [fl.every(2, fl.hooks.log(fl.writers.csv(path)))],
    )
    rows = _rows(path)
    assert [r["iteration"] for r in rows] == ["2", "4", "6"]
    assert list(rows[0]) == ["iteration", "loss", "val"]
    assert [r["loss"] for r in rows] == ["1.0", "3.0", "5.0"]
    assert [r["val"] for r in rows] == ["", "-2.0", "-5.0"]  # the column came with iteration 2's value
    step = lambda s, b: fl.record(s, other=1.0)  # noqa: E731
    fl.run(fl.TrainState(max_iter=2), step, [None] * 2, [fl.hooks.log(fl.writers.csv(path))])
    assert path.read_text() == "iteration,other\n1,1.0\n2,1.0\n"  # a run from 0 starts afresh


def test_csv_of_a_resumed_run_equals_the_uninterrupted_runs(tmp_path):
    straight, broken = tmp_path / "straight.csv", tmp_path / "broken.csv"
    log = lambda p: fl.every(2, fl.hooks.log(fl.writers.csv(p)))  # noqa: E731
    fl.run(fl.TrainState(max_iter=10), _with_late_metric, [None] * 10, [log(straight)])
    hooks = [
        log(broken),
        fl.every(3, fl.hooks.checkpoint(tmp_path / "ckpt")),
        testing.Fail(fl.Phase.AFTER_STEP, 7),
    ]
    with pytest.raises(testing.InjectedFailure):
        fl.run(fl.TrainState(max_iter=10), _with_late_metric, fl.data.resumable([None] * 10), hooks)
    with open(broken, "a") as file:
        file.write("8,7.0")  # a row torn by a crash mid-write
    resumed = fl.checkpoint.resume(tmp_path / "ckpt", like=fl.TrainState(max_iter=10))
    assert 0 < resumed.iteration < 8
    fl.run(resumed, _with_late_metric, fl.data.resumable([None] * 10), [log(broken)])
    assert broken.read_text() == straight.read_text()


def test_csv_values_read_back_as_floats_non_finite_ones_too(tmp_path):
    path = tmp_path / "m.csv"
    writer = fl.writers.csv(path)
    metrics = Metrics().record(0, {"a": float("nan"), "b": float("inf"), "c": 0.1})
    writer.write(Line(1, 2, metrics, ("a", "b", "c")))
    writer.close()
    (row,) = _rows(path)
    assert math.isnan(float(row["a"])) and float(row["b"]) == math.inf and float(row["c"]) == 0.1


def test_two_csv_writers_on_one_path_in_one_log_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"every line would be written twice"):
        fl.hooks.log(fl.writers.csv(tmp_path / "m.csv"), fl.writers.csv(tmp_path / "m.csv"))


def test_a_writer_of_ones_own_that_claims_is_claimed_and_one_that_says_no_target_is_not_checked() -> None:
    from fnloop.writers._line import Claims, WritesTo, claim, release

    calls: list[tuple[str, object]] = []

    class Mine:
        def start(self, iteration: int) -> None: ...

        def write(self, line: object) -> None: ...

        def close(self) -> None: ...

        def claim(self, owner: object = None) -> None:
            calls.append(("claim", owner))

        def release(self, owner: object = None) -> bool:
            calls.append(("release", owner))
            return True

    mine = Mine()
    assert isinstance(mine, Claims) and not isinstance(mine, WritesTo)
    claim(mine, "owner")
    assert release(mine, "owner")
    assert calls == [("claim", "owner"), ("release", "owner")]
    fl.hooks.log(mine, Mine())  # no target: nothing to compare, nothing refused
