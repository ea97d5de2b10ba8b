"""The package version (its own module, so that modules need not import the package root for it)."""

__version__ = "0.1.0"

#: what hf-merge does, in one line: `hf-merge --help` and the `hf merge` extension's manifest
SUMMARY = (
    "distributed training checkpoints (verl FSDP / Megatron, DeepSpeed ZeRO, accelerate FSDP, torchtitan, "
    "PyTorch DCP, ColossalAI) into Hugging Face models or a GGUF file"
)
