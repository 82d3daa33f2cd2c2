"""The console's text for a population: what the members share on one line, then a table of them."""

from __future__ import annotations

import logging

import torch

import fnloop as fl
from fnloop import Metrics
from fnloop.writers import Line, format_line

LABELS = ("lr=0.1", "lr=0.01", "lr=0.001")


def test_a_few_members_are_a_table_the_best_by_loss_marked():
    m = Metrics(window=5)
    m = m.record(0, {"loss/0": 2.0, "loss/1": 1.0, "loss/2": 3.0, "accuracy/0": 0.5, "time": 0.5})
    m = m.record(1, {"loss/0": 1.0, "loss/1": 0.5, "loss/2": 3.0, "accuracy/1": 0.75})
    m = m.record(1, {"lr/0": 0.1, "lr/1": 0.01, "lr/2": 0.001, "max_mem": 300.0})
    names = tuple(m.series)
    assert format_line(Line(2, 10, m, names, members=LABELS)) == (
        "eta: 0:00:04  iter: 2  time: 0.5000  max_mem: 300M\n"
        "  member       loss  accuracy         lr\n"
        "  0  lr=0.1     1.5       0.5  1.000e-01\n"
        "  1  lr=0.01   0.75      0.75  1.000e-02  best loss\n"
        "  2  lr=0.001     3         -  1.000e-03"
    )


def test_a_validation_loss_ranks_the_members_before_the_training_loss():
    m = Metrics().record(0, {"loss/0": 1.0, "loss/1": 2.0, "val_loss/0": 0.9, "val_loss/1": 0.3})
    text = format_line(Line(1, 10, m, tuple(m.series), members=LABELS[:2]))
    assert text.splitlines()[1:] == [
        "  member      loss  val_loss",
        "  0  lr=0.1      1       0.9",
        "  1  lr=0.01     2       0.3  best val_loss",
    ]


def test_many_members_are_summed_up_by_the_best_the_median_and_the_worst():
    losses = [0.5, 0.25, float("nan"), 0.75, 1.0, 0.125, 2.0, 0.375, 1.5, 0.625]  # member 2 diverged
    m = Metrics().record(0, {f"loss/{i}": v for i, v in enumerate(losses)} | {"data_time": 0.01})
    labels = tuple(f"seed={i}" for i in range(10))
    assert format_line(Line(1, 4, m, tuple(m.series), members=labels)) == (
        "iter: 1  data_time: 0.0100\n"
        "  member      loss  3 of 10 members\n"
        "  5  seed=5  0.125  best loss\n"
        "  9  seed=9  0.625  median loss\n"
        "  2  seed=2    nan  worst loss"
    )


def test_without_a_loss_the_summary_orders_by_the_first_metric_and_names_no_best():
    m = Metrics().record(0, {f"accuracy/{i}": i / 10 for i in range(9)})
    text = format_line(Line(1, 4, m, tuple(m.series), members=tuple(f"seed={i}" for i in range(9))))
    assert [row.split("  ")[-1] for row in text.splitlines()[2:]] == [
        "lowest accuracy",
        "median accuracy",
        "highest accuracy",
    ]
    few = format_line(Line(1, 4, m, ("accuracy/0", "accuracy/1"), members=LABELS[:2]))
    assert "best" not in few and "lowest" not in few


def test_a_members_block_statistics_stay_in_the_files_and_its_counts_are_not_medians():
    m = Metrics()
    for i in range(3):
        m = m.record(i, {"loss/0": 1.0, "loss/1": 1.0, "skipped/0": float(i), "grad_norm/layers.0/1": 5.0})
    text = format_line(Line(3, 10, m, tuple(m.series), members=LABELS[:2]))
    assert text.splitlines()[1:] == [
        "  member      loss  skipped",
        "  0  lr=0.1      1        2  best loss",  # a tie: the lower index
        "  1  lr=0.01     1        -",
    ]


def test_a_single_runs_line_is_unchanged():
    m = Metrics().record(0, {"loss": 2.0, "lr": 0.1, "loss/0": 1.0}).record(1, {"loss": 1.0, "time": 0.5})
    assert format_line(Line(2, 10, m, tuple(m.series))) == (
        "eta: 0:00:04  iter: 2  loss: 1.5  loss/0: 1  lr: 1.000e-01  time: 0.5000"
    )


def test_a_population_run_logs_one_record_with_its_table(caplog):
    def member(seed, lr):
        torch.manual_seed(seed)
        return fl.init(torch.nn.Linear(3, 1), fl.optim.inject(fl.optim.sgd, lr=lr), seed=seed, max_iter=4)

    def loss_fn(forward, batch):
        return forward(batch).pow(2).mean()

    population = fl.population(member, seeds=[0, 1, 2], lr=[0.1, 0.01, 0.001])
    step = fl.train_step(torch.nn.Linear(3, 1), loss_fn, fl.optim.inject(fl.optim.sgd, lr=0.1), compile=False)
    log = fl.every(4, fl.hooks.log(fl.writers.console()))
    with caplog.at_level(logging.INFO, logger="fnloop"):
        fl.run(population, step, [torch.ones(2, 3)] * 4, [log])
    (record,) = caplog.records
    rows = record.getMessage().splitlines()
    assert rows[0] == "eta: 0:00:00  iter: 4"
    assert rows[1].split() == ["member", "loss", "lr"]
    assert [row.split()[:2] for row in rows[2:]] == [["0", "lr=0.1"], ["1", "lr=0.01"], ["2", "lr=0.001"]]
    assert sum("best loss" in row for row in rows) == 1
