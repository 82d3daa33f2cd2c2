"""The field's models train under the compiled step at their library defaults.

``transformers``' GPT-2 (SDPA and eager attention), Llama (RMSNorm, rotary
embeddings, grouped keys), the mixtures of experts Qwen2-MoE, and Mixtral, OLMoE
and GraniteMoE over two layers with their routers' load-balancing loss on (routed
experts at transformers' default kernel, which it picks for a compiled graph),
BERT, ViT, ResNet (BatchNorm), ConvNeXt (drop path),
and ``torch.nn``'s ``TransformerEncoder`` and ``LSTM``, each from a tiny config
at the library's defaults: dropout on where the library has it, keyword
arguments to ``forward``, ``ModelOutput`` returns, the library's own losses
(``labels=``), tied embeddings. Every trained parameter's compiled gradient is
compared with eager autograd's (``fnloop.check_step``): a loss can agree to 1e-5
while a parameter trains on a wrong gradient. The builders live in ``tests/models_worker.py``,
which also runs the SIGKILL test's training. ``$FNLOOP_TEST_DEVICE=cuda``
runs them on a GPU (``benchmarks/device_check.sh``).

Compiled steps are shared (``_step``): each graph costs 10-30 s to build here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fnloop as fl
from fnloop import testing

pytestmark = pytest.mark.inductor(
    "the field's models as inductor compiles them: one graph each, gradients and losses against eager"
)

# The tests of one architecture share its compiled step (``_step``): one worker's each (the others,
# GPT-2's, are in its group), so the suite's workers build the architectures side by side.
GPT2 = pytest.mark.xdist_group("models-gpt2")


def _by_architecture(names: list[str], newest: tuple[str, ...] = ()) -> list:
    """Each name a case of its architecture's group; those in ``newest`` in CI's tier on the newest torch too."""
    return [
        pytest.param(
            n,
            marks=[
                pytest.mark.xdist_group(f"models-{n}"),
                *([pytest.mark.newest_torch] if n in newest else []),
            ],
        )
        for n in names
    ]


WORKER = Path(__file__).with_name("models_worker.py")
_spec = importlib.util.spec_from_file_location("models_worker", WORKER)
assert _spec is not None and _spec.loader is not None
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

OPT = cases.OPT


def zero() -> float:
    return 0.0


@functools.cache
def _step(name: str, **kwargs: object) -> fl.Step:
    _build, loss, _ = cases.CASES[name]
    return fl.train_step(cases.built(name), loss, OPT, **kwargs)


def _run(name: str, step: fl.Step, n: int = 3, model: torch.nn.Module | None = None) -> fl.TrainState:
    model = cases.built(name) if model is None else model
    batches = cases.CASES[name][2]()
    return fl.run(fl.init(model, OPT, seed=0, max_iter=n), step, batches, clock=zero)


def _losses(state: fl.TrainState) -> list[float]:
    return state.metrics.floats("loss")


@pytest.mark.parametrize("name", _by_architecture(list(cases.CASES)))
def test_each_architecture_compiles_at_its_defaults_into_one_graph(name):
    step = _step(name)
    start = fl.init(cases.built(name), OPT, seed=0, max_iter=3)
    batches = cases.CASES[name][2]()
    generator = torch.get_rng_state()
    final = fl.run(start, step, batches, clock=zero)
    assert torch.equal(torch.get_rng_state(), generator), "dropout draws from the step's seed"
    losses = _losses(final)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    assert step.compiles == 1  # one graph, no recompile
    assert fl._core.tree.first_difference(final.params, start.params) is not None, "it trained"


def _torch_losses(model: torch.nn.Module, name: str, n: int) -> list[float]:
    _build, loss_fn, batches = cases.CASES[name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for batch in batches()[:n]:
        loss = loss_fn(model, batch)  # the module itself is a `forward`
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _gpt2_without_dropout() -> torch.nn.Module:
    torch.manual_seed(0)
    return cases.gpt2(dropout=0.0).to(cases.DEVICE)


@pytest.mark.parametrize("name", _by_architecture(["gpt2", "vit", "resnet", "qwen2-moe", "mixtral", "olmoe"]))
def test_losses_equal_a_torch_optim_loop_without_dropout(name):
    # ViT, ResNet and the mixtures of experts have no dropout at their defaults; GPT-2's is turned off,
    # in a graph of its own. Mixtral's loss includes its router's load-balancing loss, as transformers adds it.
    if name == "gpt2":
        model = _gpt2_without_dropout()
        ours = _losses(_run(name, fl.train_step(model, cases.lm_loss, OPT), 5, model=model))
        theirs = _torch_losses(_gpt2_without_dropout(), name, 5)
    else:
        ours, theirs = _losses(_run(name, _step(name), 5)), _torch_losses(cases.built(name), name, 5)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=0.0)


# -- gradients, parameter by parameter --------------------------------------------------------------


@pytest.mark.parametrize("name", _by_architecture(list(cases.CASES), newest=("granitemoe",)))
def test_compiled_gradients_equal_eager_autograd_parameter_by_parameter(name):
    # A loss can agree to 1e-5 while a parameter trains on a wrong gradient (the routers of a mixture of
    # experts, on torch 2.13: fnloop/_compile/known.py). Each trained parameter's gradient and update are
    # compared; the message names the first parameter off. An architecture that draws random numbers
    # (dropout) is compared with its traced graph run op by op, which draws the same ones.
    model = cases.built(name)
    batch = cases.CASES[name][2]()[0]
    check = fl.check_step(_step(name), fl.init(model, OPT, seed=0, max_iter=1), batch)
    assert check.ok, f"{name}: {check}"
    assert check.reference == ("the graph run op by op" if name in cases.QUIET else "eager")


@pytest.mark.parametrize("name", _by_architecture(list(cases.QUIET)))
def test_the_trace_of_each_architecture_that_draws_equals_eager_autograd_with_its_randomness_off(name):
    # The other half for those: their trace against eager autograd, dropout (drop path) at 0, run op by op.
    torch.manual_seed(0)
    model = cases.QUIET[name]().to(cases.DEVICE)
    _build, loss, batches = cases.CASES[name]
    step = fl.train_step(model, loss, OPT, backend="graph")
    check = fl.check_step(step, fl.init(model, OPT, seed=0, max_iter=1), batches()[0])
    assert check.ok, f"{name}: {check}"
    assert check.reference == "eager"


@pytest.mark.xdist_group("models-llama")
def test_a_compiled_gradient_off_fails_the_check_naming_the_parameter(monkeypatch):
    # A planted wrong graph: what inductor would build is the traced graph, run op by op, writing its second
    # parameter 1% too large. The check must see it, name that parameter, and blame the compiler.
    import fnloop._compile.jit as jit

    def planted(graph, leaves, options, cache, nodes, failed):
        def wrong(*tensors):
            out = graph(*tensors)
            tensors[1].mul_(1.01)
            return out

        return wrong, None  # the graph, and its key in the compile cache: none

    monkeypatch.setattr(jit, "_built", planted)
    model = cases.built("llama")
    state = fl.init(model, OPT, seed=0, max_iter=1)
    check = fl.check_step(fl.train_step(model, cases.lm_loss, OPT), state, cases.tokens(1)[0])
    second = list(state.params)[1]
    assert not check.ok and check.first == second and check.off == (second,)
    assert f"the first {second!r}" in str(check) and "the compiler's" in str(check)


# GPT-2 at its default dropout, and a mixture of experts (Qwen2-MoE: routing, a shared expert).
LANGUAGE_MODELS = _by_architecture(["gpt2", "qwen2-moe"])


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_two_steps_per_call_equal_single_steps_bit_for_bit(name):
    single = _run(name, _step(name), 6)
    double = _run(name, _step(name, steps_per_call=2), 6)
    testing.assert_identical(double, single)
    assert _step(name, steps_per_call=2).compiles == 1


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_bf16_autocast_compiles_and_trains(name):
    step = _step(name, autocast=torch.bfloat16)
    final = _run(name, step, 3)
    assert all(torch.isfinite(torch.tensor(_losses(final))))
    assert step.compiles == 1
    assert all(p.dtype == torch.float32 for p in final.params.values()), "autocast leaves the params in fp32"


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_a_run_killed_with_sigkill_resumes_bit_exact(name, tmp_path):
    n = cases.STEPS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(WORKER), str(tmp_path), str(n), name]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as first:
        assert first.stdout is not None
        for line in first.stdout:
            if line.startswith("step 2"):
                first.send_signal(signal.SIGKILL)
                break
        assert first.wait(timeout=600) == -signal.SIGKILL
    assert fl.checkpoint.checkpoints(tmp_path / "ckpt"), "a checkpoint was left behind"
    subprocess.run(command, check=True, env=env, timeout=600, stdout=subprocess.DEVNULL)
    template = fl.init(cases.built(name), OPT, seed=0, max_iter=n)
    hooks = [fl.hooks.checkpoint(tmp_path / "whole", keep=2)]
    whole = fl.run(template, _step(name), fl.data.resumable(cases.tokens(n)), hooks, clock=zero)
    resumed = fl.load(tmp_path / "final.safetensors", like=whole)
    for field in ("iteration", "params", "buffers", "opt_state", "metrics", "data", "rng"):
        testing.assert_identical(getattr(resumed, field), getattr(whole, field))


@GPT2
def test_save_pretrained_round_trip_keeps_the_trained_and_tied_weights(tmp_path):
    from transformers import GPT2LMHeadModel

    model = cases.built("gpt2")
    final = _run("gpt2", _step("gpt2"), 3, model=model)
    assert "lm_head.weight" not in final.params, "the tied head is one parameter with the embedding"
    model.load_state_dict(fl.state_dict(final, model))
    model.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).to(cases.DEVICE).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    torch.testing.assert_close(loaded.transformer.wte.weight.detach(), final.params["transformer.wte.weight"])
    ids = cases.tokens(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)


# -- activation checkpointing ------------------------------------------------------------------------


def _checkpointed_gpt2() -> torch.nn.Module:
    model = cases.built("gpt2")
    model.activation_checkpointing_enable()  # each block recomputed in the backward, non-reentrant
    return model


@GPT2
@pytest.mark.parametrize("k", [1, 2], ids=["one-step-per-call", "two-steps-per-call"])
def test_gpt2_with_activation_checkpointing_equals_it_without_bit_for_bit(k):
    # At its default dropout (0.1): the recomputed blocks draw the masks of the first forward.
    model = _checkpointed_gpt2()
    step = fl.train_step(model, cases.lm_loss, OPT, steps_per_call=k)
    checkpointed = _run("gpt2", step, 4, model=model)
    testing.assert_identical(checkpointed, _run("gpt2", _step("gpt2"), 4))
    assert step.compiles == 1


@GPT2
def test_gpt2_with_activation_checkpointing_eagerly_equals_it_without():
    model = _checkpointed_gpt2()
    eager = fl.train_step(model, cases.lm_loss, OPT, compile=False)
    plain = fl.train_step(cases.built("gpt2"), cases.lm_loss, OPT, compile=False)
    testing.assert_identical(_run("gpt2", eager, 3, model=model), _run("gpt2", plain, 3))


@pytest.mark.xdist_group("models-qwen2-moe")
def test_a_mixture_of_experts_looping_over_its_experts_names_the_loop_and_the_implementations_that_compile():
    model = cases.built("qwen2-moe")
    model.set_experts_implementation("eager")  # a Python loop over the experts, each on its tokens
    with pytest.raises(fl.GraphBreakError) as caught:
        _run("qwen2-moe", fl.train_step(model, cases.lm_loss, OPT), 1, model=model)
    message = str(caught.value)
    assert (
        "modeling_qwen2_moe.py:" in message and "expert" in message.split("modeling_qwen2_moe.py:")[1][:120]
    )
    assert "data-dependent control flow" in message
    assert 'set_experts_implementation("grouped_mm")' in message and "compile=False" in message
