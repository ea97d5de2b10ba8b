"""What a checkpoint itself shows about the model's config, applied on top of config.json.

A reader sets :attr:`hf_merge.checkpoint.CheckpointInfo.config_overrides` when the tensors contradict
or extend config.json: a critic's value head (written as a ``*ForTokenClassification`` model with one
label) or embeddings tied (or not) unlike config.json says. The writer, the model loader and
``inspect`` apply it with :meth:`ConfigOverrides.apply`; unset fields change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ConfigOverrides:
    """config.json keys the checkpoint decides; ``None`` leaves config.json's value."""

    architectures: tuple[str, ...] | None = None
    num_labels: int | None = None
    id2label: dict[str, str] | None = None
    label2id: dict[str, int] | None = None
    token_classification_bias: bool | None = None
    tie_word_embeddings: bool | None = None

    @classmethod
    def value_head(cls, architecture: str, *, bias: bool) -> "ConfigOverrides":
        """A critic's value head as transformers' token classifier with one label."""
        return cls(
            architectures=(architecture,),
            num_labels=1,
            id2label={"0": "LABEL_0"},
            label2id={"LABEL_0": 0},
            token_classification_bias=bias,
        )

    def as_dict(self) -> dict[str, Any]:
        """The set fields as config.json values (JSON types: lists, not tuples)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, dict) else value
        return out

    def apply(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` (a config.json dict) with the set fields replaced, in place; returned for chaining."""
        config.update(self.as_dict())
        return config

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))
