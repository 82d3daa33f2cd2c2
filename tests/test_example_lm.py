"""The second example, ``python -m fnloop.examples.lm``: a GPT-2 from a config, compiled, that resumes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def lm(out: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "fnloop.examples.lm", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    # transformers warned at the first forward of a GPT2LMHeadModel, whose name names no loss
    assert "loss_type" not in done.stderr, done.stderr
    if "--quiet" not in args:
        assert "params: 446.0 K trainable, 0 frozen" in done.stderr, done.stderr  # the model summary
    return done.stdout


def test_the_example_trains_evaluates_samples_and_resumes(tmp_path):
    out = tmp_path / "lm"
    first = lm(out, "--max-iter", "4", "--eval-every", "2", "--checkpoint-every", "2", "--sample", "30")
    assert "started fresh" in first
    found = re.search(
        r"^validation loss: (\d+\.\d+) \(perplexity (\d+\.\d+) per byte\)$", first, re.MULTILINE
    )
    assert found, first
    assert float(found[1]) < 5.6, "below the loss of guessing among 256 bytes (ln 256 = 5.55)"
    assert "sample:\ndef main():\n" in first
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_perplexity" in line for line in lines)
    again = lm(
        out, "--max-iter", "6", "--eval-every", "2", "--checkpoint-every", "2", "--sample", "0", "--quiet"
    )
    assert "resumed from iteration 4" in again
