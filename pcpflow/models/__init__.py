"""pcpflow's models. A run's ``model:`` config is one of ``ModelConfig`` (picked by
``name``); ``build_model`` turns it into a ``CausalLM``.

To add a model: give its class a nested pydantic ``Config`` with a ``name`` literal and a
``from_config(config, *, dtype, seed, device)`` classmethod, then add the ``Config`` to
``ModelConfig`` and the class to ``MODEL_CLASSES``.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from pcpflow.models.base import AttentionBackend, AttentionSpec, CausalLM
from pcpflow.models.card import ModelCard
from pcpflow.models.hf import HFModel
from pcpflow.models.tiny_gqa import TinyGQA
from pcpflow.models.tiny_mla import TinyMLA

ModelConfig = Annotated[
    TinyMLA.Config | TinyGQA.Config | HFModel.Config | ModelCard, Field(discriminator="name")
]

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "tiny_mla": TinyMLA,
    "tiny_gqa": TinyGQA,
    "hf": HFModel,
}


def build_model(
    config: ModelConfig, *, dtype: torch.dtype, seed: int, device: torch.device | str = "cpu"
) -> CausalLM:
    """The model named by ``config.name``, in eval mode with gradients off; on ``device="meta"``
    its shapes only (no weights drawn or read: cheap for any size)."""
    if isinstance(config, ModelCard):
        raise ValueError(f"model card {config.name!r} has no weights: run it with mode=simulate")
    cls = MODEL_CLASSES[config.name]
    model = cls.from_config(config, dtype=dtype, seed=seed, device=device)
    return model.eval().requires_grad_(False)


def vocab_size_of(config: ModelConfig) -> int:
    """The vocabulary size a config implies, without building the model (the driver
    checks explicit prompt ids against it before any rank starts)."""
    if isinstance(config, ModelCard):
        return config.vocab_size
    return MODEL_CLASSES[config.name].vocab_size_of(config)


__all__ = [
    "MODEL_CLASSES",
    "AttentionBackend",
    "AttentionSpec",
    "CausalLM",
    "HFModel",
    "ModelCard",
    "ModelConfig",
    "TinyGQA",
    "TinyMLA",
    "build_model",
    "vocab_size_of",
]
