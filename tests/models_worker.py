"""The field's models in tiny configs, for ``tests/test_models.py``, and a run of one that checkpoints.

    python tests/models_worker.py OUT MAX_ITER [NAME]

trains the tiny model NAME (default ``gpt2``, at its defaults: dropout 0.1) compiled, resuming from
the newest checkpoint in ``OUT/ckpt``, saving one after every step and
printing ``step I`` once step ``I``'s checkpoint is on disk; at the end it
saves the final state to ``OUT/final.safetensors``. The test SIGKILLs it
mid-run, runs it again, and compares the final state with an uninterrupted
run. ``$FNLOOP_TEST_DEVICE`` (default ``cpu``) says where the models run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fnloop as fl

DEVICE = torch.device(os.environ.get("FNLOOP_TEST_DEVICE", "cpu"))
VOCAB = 64
BATCH = 4
CONTEXT = 16
STEPS = 6


def lm_loss(forward: Any, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's own loss: ``labels=`` shifts and scores every position (and logs once)."""
    return forward(input_ids=ids, labels=ids).loss


def mlm_loss(forward: Any, ids: torch.Tensor) -> torch.Tensor:
    return forward(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss


def image_loss(forward: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return forward(pixel_values=x, labels=y).loss


def token_loss(forward: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = forward(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tokens(n: int = STEPS, context: int = CONTEXT) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, context), generator=gen).to(DEVICE) for _ in range(n)]


def token_pairs(n: int = STEPS, context: int = CONTEXT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(tokens(n, context), tokens(n + 1, context)[1:]))


def short_pairs(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of 4: the trace writes an LSTM out step by step, so its graph grows with the length."""
    return token_pairs(n, 4)


def images(n: int = STEPS, side: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, side, side, generator=gen).to(DEVICE),
            torch.randint(0, 3, (BATCH,), generator=gen).to(DEVICE),
        )
        for _ in range(n)
    ]


def gpt2(dropout: float | None = None, attention: str = "sdpa") -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"vocab_size": VOCAB, "n_positions": CONTEXT, "n_embd": 32, "n_layer": 1, "n_head": 2}
    if dropout is not None:
        sizes |= {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return GPT2LMHeadModel._from_config(GPT2Config(**sizes), attn_implementation=attention)


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
    )
    return LlamaForCausalLM(config)


def qwen2_moe() -> torch.nn.Module:
    """Qwen2-MoE: four experts, two per token, a shared expert; the experts at transformers' default kernel."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
    )
    return Qwen2MoeForCausalLM(config)


def mixtral() -> torch.nn.Module:
    """Mixtral: two layers of four experts, two per token, at transformers' default experts kernel, its router's auxiliary loss on."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,  # the load-balancing loss over two layers' choices (fnloop/_compile/known.py)
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
        output_router_logits=True,  # the load-balancing loss, added to the loss by the model itself
    )
    return MixtralForCausalLM(config)


def olmoe() -> torch.nn.Module:
    """OLMoE: two layers of four experts, two per token, at transformers' default experts kernel, its router's loss on."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
        output_router_logits=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return OlmoeForCausalLM(config)


def granitemoe() -> torch.nn.Module:
    """GraniteMoE: two layers of four experts routed on the router's logits, its router's auxiliary loss on.

    On torch 2.13 inductor got its routers' gradients 100% wrong at the defaults
    (``fnloop/_compile/known.py``), while the loss agreed to 1e-5.
    """
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    config = GraniteMoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
        output_router_logits=True,
    )
    return GraniteMoeForCausalLM(config)


def bert(dropout: float | None = None) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    rates = (
        {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    )
    config = BertConfig(
        **rates,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=CONTEXT,
    )
    return BertForMaskedLM(config)


def vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    return ViTForImageClassification(config)


def resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    return ResNetForImageClassification(config)


def convnext(drop_path: float = 0.1) -> torch.nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        drop_path_rate=drop_path,
        num_labels=3,
        image_size=16,
    )
    return ConvNextForImageClassification(config)


class Encoder(torch.nn.Module):
    """``torch.nn.TransformerEncoder`` at its defaults (dropout 0.1), between an embedding and a head."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=dropout, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


class Recurrent(torch.nn.Module):
    """A two-layer ``torch.nn.LSTM`` with dropout between its layers."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.lstm = torch.nn.LSTM(32, 32, num_layers=2, batch_first=True, dropout=dropout)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


Case = tuple[Callable[[], torch.nn.Module], Callable[..., torch.Tensor], Callable[[], list[Any]]]

CASES: dict[str, Case] = {
    "gpt2": (gpt2, lm_loss, tokens),
    "gpt2-eager-attention": (lambda: gpt2(attention="eager"), lm_loss, tokens),
    "llama": (llama, lm_loss, tokens),
    "qwen2-moe": (qwen2_moe, lm_loss, tokens),
    "mixtral": (mixtral, lm_loss, tokens),
    "olmoe": (olmoe, lm_loss, tokens),
    "granitemoe": (granitemoe, lm_loss, tokens),
    "bert": (bert, mlm_loss, tokens),
    "vit": (vit, image_loss, images),
    "resnet": (resnet, image_loss, images),
    "convnext-drop-path": (convnext, image_loss, images),
    "transformer-encoder": (Encoder, token_loss, token_pairs),
    "lstm": (Recurrent, token_loss, short_pairs),
}
"""Each architecture: a builder at the library's defaults, its loss, its batches."""

QUIET: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": lambda: gpt2(dropout=0.0),
    "gpt2-eager-attention": lambda: gpt2(dropout=0.0, attention="eager"),
    "bert": lambda: bert(dropout=0.0),
    "convnext-drop-path": lambda: convnext(drop_path=0.0),
    "transformer-encoder": lambda: Encoder(dropout=0.0),
    "lstm": lambda: Recurrent(dropout=0.0),
}
"""The architectures that draw random numbers at their defaults, built with none (dropout, drop path 0):
their trace can be compared with their eager step, which draws its numbers otherwise."""


def built(name: str) -> torch.nn.Module:
    """``CASES[name]``'s model, initialised from seed 0, on ``DEVICE``."""
    torch.manual_seed(0)
    return CASES[name][0]().to(DEVICE)


OPT = fl.optim.adamw(1e-3)


def main() -> None:
    torch.set_num_threads(1)  # as the tests run: the bits of a step depend on the thread count
    out, max_iter = Path(sys.argv[1]), int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) > 3 else "gpt2"
    model = built(name)
    template = fl.init(model, OPT, seed=0, max_iter=max_iter)
    state = fl.checkpoint.resume(out / "ckpt", like=template)
    step = fl.train_step(model, CASES[name][1], OPT)

    def announce(state: fl.TrainState, phase: fl.Phase) -> fl.TrainState:
        # The checkpoint of step I is written when its AFTER_STEP effects run; this comes after it.
        if phase is fl.Phase.BEFORE_STEP and state.iteration > 0:
            print(f"step {state.iteration - 1}", flush=True)
        return state

    hooks = [announce, fl.hooks.checkpoint(out / "ckpt", keep=2)]
    final = fl.run(state, step, fl.data.resumable(tokens(max_iter)), hooks, clock=lambda: 0.0)
    fl.save(final, out / "final.safetensors")


if __name__ == "__main__":
    main()
