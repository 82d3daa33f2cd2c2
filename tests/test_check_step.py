"""``fl.check_step``'s own conduct: what it says beside its table (the gradients it checks are the models suite's)."""

from __future__ import annotations

import warnings

import torch

import fnloop as fl


def _embedding_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 5, 2))

    def loss_fn(forward, batch):
        ids, y = batch
        return torch.nn.functional.cross_entropy(forward(ids), y)

    opt = fl.optim.adamw(1e-3)
    batch = (torch.randint(0, 20, (16, 5)), torch.randint(0, 2, (16,)))
    return fl.train_step(model, loss_fn, opt), fl.init(model, opt, seed=0, max_iter=1), batch


def _varying(caught) -> int:
    return sum(str(w.message).startswith("fnloop: this compiled step adds into tensors") for w in caught)


def test_the_checks_own_steps_do_not_repeat_the_users_steps_warning():
    """An embedding's gradient varies in its order with several threads: the user's step says so once;
    the steps the check builds beside it (its gradients, the graph op by op) say nothing more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        step, state, batch = _embedding_step()
        with warnings.catch_warnings(record=True) as alone:
            warnings.simplefilter("always")
            fl.run(state, step, [batch])
        step, state, batch = _embedding_step()
        with warnings.catch_warnings(record=True) as checked:
            warnings.simplefilter("always")
            check = fl.check_step(step, state, batch)
    finally:
        torch.set_num_threads(threads)
    assert check.ok, check
    assert _varying(alone) == 1, [str(w.message) for w in alone]
    assert _varying(checked) == 1, [str(w.message) for w in checked]
