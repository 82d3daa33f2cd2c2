"""The model summary: per-block counts that add up to the model's, trainable and frozen, logged at the start."""

from __future__ import annotations

import logging

import pytest
import torch

import fnloop as fl
from fnloop.hooks import model_summary, summary


def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=64)
    return transformers.GPT2LMHeadModel(config)


def numbers(text: str) -> list[str]:
    return [line.split() for line in text.splitlines()[1:-1]]


def test_a_transformers_model_is_counted_once_per_tensor_block_by_block():
    model = gpt2()
    model.transformer.wpe.requires_grad_(False)
    text = summary(model, depth=2)
    rows = {row[0]: row for row in numbers(text)}
    assert set(rows) == {"transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f"}, text
    assert rows["transformer.h"][1] == "ModuleList" and rows["transformer.wpe"][1] == "Embedding"
    unique = {id(p): p for p in model.parameters()}.values()  # lm_head is tied to wte: counted once
    total = sum(p.numel() for p in unique)
    frozen = model.transformer.wpe.weight.numel()
    last = text.splitlines()[-1]
    assert last.startswith(
        f"{total / 1e3:.1f} K params: {(total - frozen) / 1e3:.1f} K trainable, {frozen} frozen;"
    )
    assert rows["transformer.wpe"][3] == "0" and rows["transformer.wpe"][2] == str(frozen)
    top = {row[0] for row in numbers(summary(model))}
    assert top == {"transformer"}, summary(model)


def test_the_hook_logs_the_summary_once_as_the_run_starts(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=3)
    step = fl.train_step(model, lambda f, b: f(b).sum(), fl.optim.sgd(0.1), compile=False)
    with caplog.at_level(logging.INFO, logger="fnloop"):
        fl.run(state, step, [torch.ones(2, 4)] * 3, [model_summary(model)])
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model:")]
    assert logged == ["model:\n" + summary(model)]
    assert "58 params: 58 trainable, 0 frozen; 232 B" in logged[0]


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        summary({"w": torch.ones(1)})
    with pytest.raises(ValueError, match="must be a positive int"):
        model_summary(torch.nn.Linear(1, 1), depth=0)
