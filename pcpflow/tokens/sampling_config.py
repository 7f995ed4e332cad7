"""The run's ``sampling:`` section, without torch (``pcpflow.tokens.sampling`` draws by it)."""

from __future__ import annotations

from pydantic import Field

from pcpflow.errors import Settings


class SamplingConfig(Settings):
    """``sampling.*``: how a token is chosen from the logits (temperature 0 = greedy)."""

    temperature: float = Field(0.0, ge=0, description="0: greedy (argmax); > 0: softmax(logits / T)")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the fewest top tokens whose probability sums to >= top_p")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    seed: int | None = Field(None, ge=0, description="seed of the draws; null = the run's seed")
    repetition_penalty: float | None = Field(
        None, gt=0,
        description=("transformers' repetition penalty on every token a request has seen (prompt and outputs): "
                     "a positive logit divided by it, a negative one multiplied; 1 = off; null = the checkpoint's "
                     "generation_config.json value (as transformers' generate applies it, greedy too), else 1"),
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
