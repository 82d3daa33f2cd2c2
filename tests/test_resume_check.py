"""``fnloop.replay.check_resume``: a job that resumes exactly passes, each planted defect is caught and named.

The jobs are in ``tests/resume_worker.py``; each check runs them in fresh processes (a straight run,
then for each interruption one interrupted run and one resumed), eagerly and tiny.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fnloop as fl
from fnloop.cli import main as cli
from fnloop.replay import ResumeCheckError, check_resume

from . import resume_worker

JOBS = "tests.resume_worker"


def checked(tmp_path: Path, name: str, **options) -> fl.replay.ResumeReport:
    report = check_resume(f"{JOBS}:{name}", tmp_path, **options)
    print(report)
    return report


def test_a_job_that_resumes_exactly_passes_a_kill_between_checkpoints_and_a_preemption(
    tmp_path: Path,
) -> None:
    report = checked(tmp_path, "good")
    assert report.identical and report.steps == resume_worker.MAX_ITER
    # By default, halfway between the first two checkpoints (4 and 8): the kill resumes from 4,
    # redoing three steps; the preemption saves on its way out and resumes where it stopped.
    assert [(i.how, i.at, i.done, i.resumed_from) for i in report.interruptions] == [
        ("kill", 7, 7, 4),
        ("preempt", 7, 7, 7),
    ]
    # The check compared the writers' files: both logs are there, and the fingerprints of every step.
    assert (tmp_path / "kill-7" / "job" / "metrics.csv").exists()
    assert len(fl.replay.read_log(tmp_path / "kill-7" / "check" / "fingerprints.jsonl")) == 12


def test_an_interruption_inside_a_call_of_several_steps_comes_after_the_call(tmp_path: Path) -> None:
    report = checked(tmp_path, "several", at=[7])
    assert report.identical
    assert [(i.how, i.done, i.resumed_from) for i in report.interruptions] == [
        ("kill", 8, 8),
        ("preempt", 8, 8),
    ]


def test_a_job_that_does_not_resume_is_told_so(tmp_path: Path) -> None:
    (found,) = checked(tmp_path, "no_resume", how=["kill"]).interruptions
    assert found.resumed_from == 0
    assert "did not resume" in found.differences[0] and "fl.checkpoint.resume" in found.differences[0]


def test_a_hook_keeping_memory_in_a_closure_is_caught_in_the_state_and_the_logs(tmp_path: Path) -> None:
    (found,) = checked(tmp_path, "closure", how=["kill"]).interruptions
    said = "\n".join(found.differences)
    assert (
        "final state: state.metrics.series['loss_mean']" in said
        and "(the metrics; the straight run's value first)" in said
    )
    assert "file metrics.jsonl: line 3" in said and "file metrics.csv" in said
    # The parameters never saw the closure: the steps themselves are the same.
    assert "the steps part" not in said


def test_a_data_source_that_restarts_is_caught_at_the_first_resumed_step(tmp_path: Path) -> None:
    (found,) = checked(tmp_path, "restarts", how=["kill"]).interruptions
    said = "\n".join(found.differences)
    assert "state.params" in said and "(the parameters;" in said
    assert "the steps part at the first step after the resume (resumed at 4)" in said
    assert "data source that restarts" in said


def test_a_schedule_read_from_the_wall_clock_is_caught(tmp_path: Path) -> None:
    (found,) = checked(tmp_path, "wall_clock", how=["kill"]).interruptions
    said = "\n".join(found.differences)
    assert "state.params" in said and "the wall clock" in said
    assert "file metrics.jsonl" in said  # its lr column


def test_a_writer_that_does_not_cut_back_is_caught_by_its_file(tmp_path: Path) -> None:
    (found,) = checked(tmp_path, "duplicates", how=["kill"]).interruptions
    (said,) = found.differences  # the state and fnloop's own writers are right
    assert said.startswith("file appended.jsonl: line 4")
    assert "8 lines, the straight run's 6: lines written again after the resume" in said


@pytest.mark.parametrize("job", ["digits_job", "lm_job"])
def test_the_examples_resume_exactly(tmp_path: Path, job: str) -> None:
    # As their main() runs them: the digits example with its evaluation, best checkpoint,
    # TensorBoard and JSON lines; GPT-2 from a tiny config. The best state is compared as a state.
    report = checked(tmp_path, job)
    assert report.identical and len(report.interruptions) == 2


def test_the_command_line_says_it_and_exits_1_on_a_difference(tmp_path: Path, capsys) -> None:
    assert cli(["check-resume", f"{JOBS}:restarts", str(tmp_path), "--at", "5", "--how", "kill"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("the job does NOT resume exactly (12 steps, 1 interruptions)")
    assert "kill at 5, resumed from 4: DIFFERS" in out


def test_what_the_check_cannot_run_is_refused_with_the_fix(tmp_path: Path, capsys) -> None:
    with pytest.raises(ResumeCheckError, match="cannot be imported by a fresh process"):
        check_resume(lambda directory: None, tmp_path)
    with pytest.raises(
        ResumeCheckError,
        match=r"_net\(\) -> 'nn.Module' cannot be called with one argument.*job\(directory\)",
    ):
        check_resume(resume_worker._net, tmp_path)
    with pytest.raises(ResumeCheckError, match="module:function"):
        check_resume("tests.resume_worker", tmp_path)
    with pytest.raises(ValueError, match="'kill', 'preempt'"):
        check_resume(resume_worker.good, tmp_path, how=["crash"])
    with pytest.raises(ResumeCheckError, match="runs 12 steps, so an interruption comes once 1 to 11"):
        check_resume(resume_worker.good, tmp_path, at=[12])
    # Run again in the same directory, the straight run resumes from the first one's end.
    assert cli(["check-resume", f"{JOBS}:good", str(tmp_path)]) == 2
    assert "began at iteration 12, not 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"at": []}, r"at=\[\]\) would interrupt nothing"),
        ({"how": []}, r"how=\[\]\) would interrupt nothing"),
        ({"how": "kill"}, r"takes a list of interruptions .* for one, pass how=\['kill'\]"),
        ({"how": ["stop"]}, r"takes 'kill', 'preempt' \(got 'stop'"),
        ({"at": 3}, r"takes a list of step counts .* at=\[3\]"),
        ({"at": [2.5]}, r"whole numbers of steps done, 1 or more \(got 2.5"),
        ({"at": [True]}, r"whole numbers of steps done, 1 or more \(got True"),
        ({"at": [0]}, r"whole numbers of steps done, 1 or more \(got 0"),
        ({"timeout": -1}, r"timeout=...\) takes the seconds .* \(got -1"),
        ({"timeout": float("nan")}, r"timeout=...\) takes the seconds .* \(got nan"),
        ({"timeout": True}, r"timeout=...\) takes the seconds .* \(got True"),
    ],
)
def test_an_argument_that_would_check_nothing_or_fail_late_is_refused_before_any_run(
    tmp_path: Path, options, match
) -> None:
    # Before anything runs: the job here cannot even be imported, and the directory stays empty.
    with pytest.raises(ValueError, match=match):
        check_resume("no_such_module:job", tmp_path, **options)
    assert not any(tmp_path.iterdir())


def test_the_hint_for_kernels_that_vary_names_a_switch_that_exists() -> None:
    import inspect
    import re

    from fnloop._resumefiles import step_hint

    hint = step_hint(1, 5)  # a difference before the interruption
    name = re.search(r"fl\.(\w+)\(\.\.\., deterministic=True\)", hint)
    assert name is not None, hint
    assert "deterministic" in inspect.signature(getattr(fl, name.group(1))).parameters, hint
