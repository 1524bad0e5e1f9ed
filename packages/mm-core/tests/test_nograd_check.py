"""``mm check`` names the parameters that train nothing: frozen ones with their reason (``model.freeze`` or
the model plan's ``frozen_reasons``), and, with ``--grad-probe``, trainable ones that one micro-batch of
the configured data gives no gradient (a toy model with an unused module)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from mm_core.check import NOT_PROBED, run_check
from mm_core.cli import build_parsers
from mm_core.config.loader import validate_config
from mm_core.models import BaseModel, ModelArguments, ModelPlan
from mm_core.models.nograd import frozen_groups, path_shape, probe_gradients
from mm_core.registry import data_register, model_register

VOCAB, DIM = 32, 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)  # built, never called: gets no gradient
        self.selector = nn.Linear(DIM, 2, bias=False)  # frozen by the model itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.used(x)


@model_register.register("test_nograd_toy")
class ToyModel(nn.Module, BaseModel):
    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        frozen_reasons=(("layers.{*}.selector", "selects, is never trained"),)
    )

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(DIM, VOCAB)
        for block in self.layers:
            block.selector.requires_grad_(False)

    @classmethod
    def _from_config(cls, args: ModelArguments) -> nn.Module:
        return cls()

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> nn.Module:
        return cls()

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        return {"logits": self.head(h)}


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(6) + i) % VOCAB
        return {"input_ids": ids, "labels": ids}


@data_register.register("test_nograd_tokens")
def _tokens(**kwargs: Any) -> _Tokens:
    return _Tokens()


def config(**model: Any) -> Any:
    return validate_config(
        {
            "data": {"dataset_param": {"dataset_type": "test_nograd_tokens"}},
            "model": {"model_id": "test_nograd_toy", "from_scratch": True, **model},
            "training": {"train_iters": 1, "micro_batch_size": 2},
        }
    )


def test_path_shape_generalises_layer_indices():
    assert path_shape("model.layers.3.mlp.experts") == "model.layers.{*}.mlp.experts"
    assert path_shape("0.weight") == "{*}.weight"
    assert path_shape("model.v2.x") == "model.v2.x"


def test_frozen_parameters_are_grouped_with_their_reason():
    model = ToyModel()
    model.head.requires_grad_(False)  # as model.freeze: [head] would
    groups = frozen_groups(model, ["head"])
    assert [(g.shape, g.modules, g.tensors, g.elements) for g in groups] == [
        ("layers.{*}.selector", 2, 2, 2 * 2 * DIM),
        ("head", 1, 2, VOCAB * DIM + VOCAB),
    ]
    assert groups[0].reason == "frozen by ToyModel: selects, is never trained"
    assert groups[1].reason == "model.freeze"
    model.embed.requires_grad_(False)  # frozen by nobody who says why
    assert frozen_groups(model, ["head"])[0].reason == "frozen by ToyModel (no reason given)"


def test_probe_lists_the_unused_module_only():
    model = ToyModel()
    batch = {"input_ids": torch.arange(6).view(1, 6), "labels": torch.arange(6).view(1, 6)}
    groups, trainable = probe_gradients(model, batch, config().model.loss_cfg)
    assert trainable == 1 + 2 * 4 + 2  # embed, 2 x (used, unused), head; the selectors are frozen
    assert [(g.shape, g.modules, g.tensors) for g in groups] == [("layers.{*}.unused", 2, 4)]
    assert model.layers[0].used.weight.grad is not None and model.layers[0].selector.weight.grad is None


def test_check_prints_frozen_reasons_and_the_hint(capsys):
    run_check(config(freeze=["head"]), 1)
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("frozen      :"))
    elements = 2 * 2 * DIM + VOCAB * DIM + VOCAB
    assert out[at] == f"frozen      : {elements:,} parameters in 4 tensors (no gradient, no optimizer state)"
    assert out[at + 1].split() == [
        "layers.{*}.selector",
        "2",
        "modules,",
        "2",
        "tensors,",
        "32",
        "elements:",
        "frozen",
        "by",
        "ToyModel:",
        "selects,",
        "is",
        "never",
        "trained",
    ]
    assert out[at + 2].split()[0] == "head" and out[at + 2].endswith(": model.freeze")
    assert out[at + 3] == NOT_PROBED


def test_check_grad_probe_names_the_unused_module(capsys):
    run_check(config(), 1, probe_grads=True)
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("gradients   :"))
    assert out[at].startswith("gradients   : probed with the first micro-batch (2 x 6 tokens, CPU, fp32")
    assert "4 of 11 trainable tensors got NO gradient" in out[at]
    assert out[at + 1].split()[:3] == ["layers.{*}.unused", "2", "modules,"]


def test_cli_accepts_grad_probe():
    args = build_parsers()["check"].parse_intermixed_args(["cfg.yaml", "--grad-probe", "training.lr=1"])
    assert args.grad_probe and args.overrides == ["training.lr=1"]
    assert not build_parsers()["check"].parse_intermixed_args(["cfg.yaml"]).grad_probe


@pytest.mark.parametrize("loss_type", ["per_sample_loss", "raw"])
def test_probe_uses_the_configured_loss(loss_type):
    class WithLoss(ToyModel):
        def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
            out = super().forward(input_ids)
            labels = kwargs.get("labels")
            if labels is not None:
                out["loss"] = nn.functional.cross_entropy(out["logits"].flatten(0, 1), labels.flatten())
            return out

    model = WithLoss()
    batch = {"input_ids": torch.arange(6).view(1, 6), "labels": torch.arange(6).view(1, 6)}
    cfg = config(loss_cfg={"loss_type": loss_type}).model.loss_cfg
    groups, _ = probe_gradients(model, batch, cfg)
    assert [g.shape for g in groups] == ["layers.{*}.unused"]
