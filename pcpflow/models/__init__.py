"""pcpflow's models. A run's ``model:`` config is one of ``ModelConfig`` (picked by ``name``;
``pcpflow.models.config``, without torch); ``build_model`` turns it into a ``CausalLM``.

To add a model: its pydantic config in ``pcpflow.models.config``, joined to ``ModelConfig``;
its class with that config as ``Config`` and a ``from_config(config, *, dtype, seed, device)``
classmethod, added to ``model_classes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pcpflow.models.card import ModelCard
from pcpflow.models.config import ModelConfig, vocab_size_of

if TYPE_CHECKING:
    import torch

    from pcpflow.models.base import CausalLM


def model_classes() -> dict[str, type[CausalLM]]:
    """Each executable model's class by its config's ``name`` (torch is imported here)."""
    from pcpflow.models.hf import HFModel
    from pcpflow.models.tiny_gqa import TinyGQA
    from pcpflow.models.tiny_mla import TinyMLA

    return {"tiny_mla": TinyMLA, "tiny_gqa": TinyGQA, "hf": HFModel}


def build_model(
    config: ModelConfig, *, dtype: torch.dtype, seed: int, device: torch.device | str = "cpu"
) -> CausalLM:
    """The model named by ``config.name``, in eval mode with gradients off; on ``device="meta"``
    its shapes only (no weights drawn or read: cheap for any size)."""
    if isinstance(config, ModelCard):
        raise ValueError(f"model card {config.name!r} has no weights: run it with mode=simulate")
    model = model_classes()[config.name].from_config(config, dtype=dtype, seed=seed, device=device)
    return model.eval().requires_grad_(False)


__all__ = ["ModelCard", "ModelConfig", "build_model", "model_classes", "vocab_size_of"]
