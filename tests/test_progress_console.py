"""The progress bar and the console writer together, on a real pseudo-terminal and without one.

A child process runs a tiny ``fnloop.run`` with ``hooks.progress()`` and
``every(k, hooks.log(writers.console()))``; its stderr is a pty (or a pipe), and
what it wrote is read back as bytes and replayed on a small model of a terminal
(carriage return, line feed, cursor up), so that the tests see what a user sees.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import fnloop as fl
from fnloop import hooks, writers

pytest.importorskip("tqdm")

ROOT = Path(fl.__file__).resolve().parents[1]

CHILD = """
import sys

import fnloop as fl
from fnloop import hooks, writers


def step(state, batch):
    return fl.record(state, loss=1.0 / (state.iteration + 1))


def run(progress_first):
    log = fl.every(10, hooks.log(writers.console()))
    bar = hooks.progress(mininterval=0)  # a redraw after every step: as many chances to collide as can be
    fl.run(fl.TrainState(max_iter=25), step, range(25), [bar, log] if progress_first else [log, bar])


run(progress_first=True)
print("=== the next run ===", file=sys.stderr, flush=True)
run(progress_first=False)
"""
"""Two runs of 25 steps, a console line every 10 and at the end: the bar's hook first, then last."""

LOG_LINE = re.compile(r"\[\d\d/\d\d \d\d:\d\d:\d\d fnloop\] (eta: 0:00:00  )?iter: (\d+)  loss: [0-9.]+")
"""A console line as the console writer's own handler writes it, whole."""

BAR = re.compile(r"\d+%\|")


def screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: each line as it stands once every overwrite is done."""
    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(text):
        char = text[i]
        i += 1
        if char == "\r":
            col = 0
        elif char == "\n":
            row += 1
            if row == len(rows):
                rows.append([])
        elif char == "\x1b":
            escape = re.match(r"\[(\d*)A", text[i:])
            assert escape is not None, f"an escape sequence this model does not know: {text[i : i + 8]!r}"
            row = max(row - int(escape.group(1) or 1), 0)
            i += escape.end()
        else:
            line = rows[row]
            line.extend(" " * (col - len(line) + 1))
            line[col] = char
            col += 1
    shown = ["".join(line).rstrip() for line in rows]
    while shown and not shown[-1]:
        shown.pop()
    return shown


def test_the_terminal_model_overwrites_in_place():
    assert screen("\r 10%|#  | 1/10\r 20%|## | 2/10\r" + " " * 14 + "\rlog\n\r 20%|## | 2/10\r\n") == [
        "log",
        " 20%|## | 2/10",
    ]
    assert screen("a long bar\rshort") == ["shortg bar"]  # a stale half bar stays: it is seen


def child(stderr_is_a_terminal: bool) -> bytes:
    """The bytes the child wrote to its stderr, a pty 100 columns wide or a pipe."""
    command = [sys.executable, "-c", CHILD]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not stderr_is_a_terminal:
        done = subprocess.run(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=300
        )
        assert done.returncode == 0, done.stderr.decode()
        return done.stderr
    master, slave = pty.openpty()
    # A new pty is 0 columns wide (tqdm would draw an empty bar); a terminal window has a size.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the slave is closed, the child has exited
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        returncode = process.wait(timeout=60)
    assert returncode == 0, bytes(out).decode(errors="replace")
    return bytes(out)


def runs(shown: list[str]) -> list[list[str]]:
    """The screen's lines, split into the child's two runs."""
    at = shown.index("=== the next run ===")
    return [shown[:at], shown[at + 1 :]]


def test_on_a_terminal_each_console_line_is_whole_above_the_bar_and_the_final_bar_is_shown_once():
    out = child(stderr_is_a_terminal=True)
    # Each console line starts a line of its own: the live bar is cleared first ("\r", spaces, "\r").
    before = re.findall(rb"(.)\[\d\d/\d\d \d\d:\d\d:\d\d fnloop\]", out, flags=re.DOTALL)
    assert len(before) == 6 and set(before) <= {b"\r", b"\n"}, before
    first, second = runs(screen(out.decode()))
    for shown in (first, second):
        logged = [line for line in shown if "fnloop]" in line]
        assert [LOG_LINE.fullmatch(line) is not None for line in logged] == [True] * 3, shown
        assert [int(LOG_LINE.fullmatch(line)[2]) for line in logged] == [10, 20, 25]  # type: ignore[index]
        bars = [line for line in shown if BAR.search(line)]
        assert len(bars) == 1 and bars[0].startswith("100%|") and "| 25/25 [" in bars[0], shown
        assert len(shown) == 4, shown  # three console lines and the bar: nothing else, no half bar
    # The bar's hook first: it closes the bar before the log's last write, which is printed below it.
    assert BAR.search(first[2]) and "iter: 25" in first[3]
    # The log first: its last line goes above the live bar, which closes last.
    assert "iter: 25" in second[2] and BAR.search(second[3])


def test_without_a_terminal_there_is_no_bar_and_no_control_character():
    out = child(stderr_is_a_terminal=False)
    assert b"\r" not in out and b"\x1b" not in out and b"%|" not in out and "█".encode() not in out
    lines = out.decode().splitlines()
    assert lines[3] == "=== the next run ==="
    del lines[3]
    assert [int(LOG_LINE.fullmatch(line)[2]) for line in lines] == [10, 20, 25] * 2  # type: ignore[index]


# -- in this process: logging configured by the user --------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_logged_through_the_users_own_root_handler_go_above_the_bar(monkeypatch):
    # logging.basicConfig's setup: a stream handler on the root logger, the "fnloop" logger none.
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(terminal)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root, fnloop_logger = logging.getLogger(), logging.getLogger("fnloop")
    monkeypatch.setattr(root, "handlers", [*root.handlers, handler])
    monkeypatch.setattr(fnloop_logger, "handlers", [])
    monkeypatch.setattr(fnloop_logger, "level", logging.INFO)
    step = lambda s, b: fl.record(s, loss=1.0 / (s.iteration + 1))  # noqa: E731
    log = fl.every(10, hooks.log(writers.console()))
    fl.run(fl.TrainState(max_iter=25), step, range(25), [log, hooks.progress(mininterval=0)])
    shown = screen(terminal.getvalue())
    assert [line.split("  loss")[0] for line in shown[:3]] == [
        "INFO iter: 10",
        "INFO iter: 20",
        "INFO eta: 0:00:00  iter: 25",
    ]
    assert len(shown) == 4 and shown[3].startswith("100%|") and "| 25/25 [" in shown[3]
    assert root.handlers[-1] is handler and fnloop_logger.handlers == []  # tqdm's redirect is undone


def test_a_terminal_handler_that_drops_info_still_drops_it_while_a_bar_is_live(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(terminal)
    handler.setLevel(logging.WARNING)
    root, fnloop_logger = logging.getLogger(), logging.getLogger("fnloop")
    monkeypatch.setattr(root, "handlers", [*root.handlers, handler])
    monkeypatch.setattr(fnloop_logger, "handlers", [])
    monkeypatch.setattr(fnloop_logger, "level", logging.INFO)
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    fl.run(
        fl.TrainState(max_iter=5),
        step,
        range(5),
        [fl.every(2, hooks.log(writers.console())), hooks.progress()],
    )
    assert "loss" not in terminal.getvalue() and "100%|" in terminal.getvalue()
