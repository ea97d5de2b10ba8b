"""Time to plan the Hub layout (specs only, no data) of real-width models built on the meta device.

    python benchmarks/bench_hub_layout.py            # Qwen2-7B (dense) and Qwen3-30B-A3B (48 layers, 128 experts)

Prints, per model, the seconds :func:`hf_merge.transforms.hub_layout.hub_layout` takes (model
skeleton on the meta device + transformers' reverse conversion + the per-tensor recipes) and the
number of output tensors. Nothing is read or written.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def main() -> None:
    import transformers

    from hf_merge.checkpoint import CheckpointInfo, LazyCheckpoint
    from hf_merge.spec import TensorSpec
    from hf_merge.transforms.hub_layout import hub_layout

    class Specs(LazyCheckpoint):
        def __init__(self, state):
            self.info = CheckpointInfo("meta", Path("."))
            self._specs = {k: TensorSpec(k, tuple(v.shape), v.dtype) for k, v in state.items()}

        def specs(self):
            return self._specs

    models = {
        "Qwen2-7B (dense)": transformers.Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064, architectures=["Qwen2ForCausalLM"]),
        "Qwen3-30B-A3B (48 layers, 128 experts)": transformers.Qwen3MoeConfig(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
            vocab_size=151936, architectures=["Qwen3MoeForCausalLM"]),
    }
    for name, cfg in models.items():
        with torch.device("meta"):
            state = getattr(transformers, cfg.architectures[0])(cfg).state_dict()
        t0 = time.perf_counter()
        view, _ = hub_layout(Specs(state), cfg.to_dict())
        print(f"{name}: {time.perf_counter() - t0:.2f} s, {len(state)} tensors -> {len(view.specs())}")


if __name__ == "__main__":
    main()
