"""``hf-merge merge SOURCE TARGET``: also accepts verl's ``model_merger`` spellings."""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("hf_merge.cli")

EXAMPLES = """examples:
  hf-merge merge checkpoints/global_step_100/actor ./merged
  hf-merge merge checkpoints/ ./merged --dtype bfloat16 --max-shard-size 2GB
  hf-merge merge checkpoints/ ./merged-nf4 --quantize nf4 --double-quant   # bitsandbytes 4-bit
  hf-merge merge --backend fsdp --local_dir checkpoints/global_step_100/actor --target_dir ./merged   # verl's spelling
"""

# verl flags that change nothing here, with the reason shown once when given.
IGNORED_VERL_FLAGS = {
    "use_cpu_initialization": "--use_cpu_initialization is not needed: hf-merge never builds the model to merge",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="merge a sharded checkpoint into a Hugging Face model folder",
        description="Merge a sharded training checkpoint into a Hugging Face model folder (safetensors + config + tokenizer).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", nargs="?", help="checkpoint folder: actor/, global_step_N/, or the checkpoints root")
    p.add_argument("target", nargs="?", help="output folder (written atomically)")
    p.add_argument("--local_dir", "--local-dir", dest="local_dir", help="verl spelling of SOURCE")
    p.add_argument("--target_dir", "--target-dir", dest="target_dir", help="verl spelling of TARGET")
    p.add_argument("--backend", default="auto", choices=["auto", "fsdp", "megatron", "hf"], help="source format (default: detect)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16", "auto"],
        help="output dtype; default: the config's dtype; auto: keep the checkpoint's",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    p.add_argument("--workers", type=int, default=None, help="processes writing output files (default: one per file, one per two CPUs, at most 8)")
    p.add_argument("--config", "--hf_model_path", "--hf-model-path", dest="config", help="folder with config.json and tokenizer, if the checkpoint has no huggingface/ folder")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted for verl compatibility; hf-merge never runs checkpoint code to merge")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty target folder")
    p.add_argument("--is-value-model", action="store_true", default=None, help="write a critic's value head as score.weight (Megatron)")
    p.add_argument("--tie-word-embedding", action="store_true", help="accepted for verl compatibility; ties follow config.json")
    p.add_argument("--use_cpu_initialization", "--use-cpu-initialization", action="store_true", help=argparse.SUPPRESS)
    lora = p.add_argument_group("LoRA (PEFT checkpoints)")
    lora.add_argument("--lora", default="both", choices=["fuse", "adapter", "both"],
                      help="fuse: model with LoRA folded in; adapter: a PEFT adapter folder; both (default): fused model + TARGET/lora_adapter/")
    lora.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha, when the checkpoint does not record it")
    lora.add_argument("--use-rslora", action="store_true", default=None, help="the adapter was trained with rsLoRA (scale alpha/sqrt(r))")
    lora.add_argument("--base-model", default=None, help="HF folder with the base weights, for save_lora_only checkpoints")
    lora.add_argument("--base-model-name", default=None, help="base_model_name_or_path for adapter_config.json and the model card")
    hub = p.add_argument_group("Hugging Face Hub")
    hub.add_argument("--push-to-hub", "--hf_upload_path", "--hf-upload-path", dest="push_to_hub", metavar="REPO_ID",
                     help="upload the finished folder to this model repo (token from HF_TOKEN or `hf auth login`)")
    hub.add_argument("--private", action=argparse.BooleanOptionalAction, default=None, help="create the repo private / public")
    p.add_argument("--verify", action="store_true", help="re-read the output and compare it with the source before finishing")
    p.add_argument("--no-checksums", dest="checksums", action="store_false", help="skip recording sha256 of output files")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    q = p.add_argument_group("quantized output (needs: pip install 'hf-merge[quantize]')")
    q.add_argument("--quantize", choices=["nf4", "fp4", "int8"], default=None, help="write bitsandbytes 4-bit (nf4, fp4) or 8-bit (int8) weights, as transformers saves them")
    q.add_argument("--double-quant", action="store_true", help="4-bit: quantize the scales too (bnb_4bit_use_double_quant)")
    q.add_argument("--quant-compute-dtype", choices=["float32", "bfloat16", "float16"], default=None, help="4-bit: bnb_4bit_compute_dtype (default: the output dtype)")
    q.add_argument("--quant-skip-modules", default=None, metavar="M1,M2", help="comma-separated modules to keep unquantized, besides lm_head and tied embeddings (llm_int8_skip_modules matching)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ..errors import HfMergeError
    from ..distributed import launched_by_torchrun
    from ..preflight import check_merge

    source = args.source or args.local_dir
    target = args.target or args.target_dir
    if args.source and args.local_dir and args.source != args.local_dir:
        raise HfMergeError("both SOURCE and --local_dir given; pass one")
    if not source or not target:
        raise HfMergeError("need a SOURCE and a TARGET: hf-merge merge SOURCE TARGET (or --local_dir X --target_dir Y)")
    if not launched_by_torchrun():  # a rank of a distributed merge reports to the others instead
        check_merge(source, target, overwrite=args.overwrite, backend=args.backend, config=args.config,
                    base_model=args.base_model, quantize=args.quantize)  # before torch is imported
    for flag, message in IGNORED_VERL_FLAGS.items():
        if getattr(args, flag, False):
            logger.info(message)
    from ..merging import merge

    result = merge(
        source,
        target,
        backend=args.backend,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        workers=args.workers,
        config=args.config,
        overwrite=args.overwrite,
        lora=args.lora,
        lora_alpha=args.lora_alpha,
        use_rslora=args.use_rslora,
        base_model=args.base_model,
        base_model_name=args.base_model_name,
        verify=args.verify,
        checksums=args.checksums,
        quantize=_quantize_options(args),
        push_to_hub=args.push_to_hub,
        private=args.private,
        is_value_model=args.is_value_model,
    )
    if result.rank != 0:  # a distributed merge reports once, from rank 0
        return 0
    if args.json:
        print(json.dumps({
            "target": str(result.target), "files": result.files, "dtype": result.dtype,
            "tensors": result.num_tensors, "bytes": result.total_bytes, "notes": result.notes, "url": result.url,
        }, indent=2))
    elif not getattr(args, "quiet", False):
        size = result.total_bytes / 1e9
        print(f"wrote {result.target} ({result.num_tensors} tensors, {size:.2f} GB, {len(result.files)} file(s), dtype {result.dtype or 'as trained'})", file=sys.stderr)
        if result.url:
            print(f"pushed to {result.url}", file=sys.stderr)
    return 0


def _quantize_options(args: argparse.Namespace):
    """--quantize and its companion flags -> QuantizeOptions (None without --quantize)."""
    from ..errors import QuantizationError

    given = {"--double-quant": args.double_quant, "--quant-compute-dtype": args.quant_compute_dtype, "--quant-skip-modules": args.quant_skip_modules}
    if args.quantize is None:
        extra = [flag for flag, value in given.items() if value]
        if extra:
            raise QuantizationError(f"{extra[0]} needs --quantize nf4|fp4|int8")
        return None
    from ..transforms.quantize import QuantizeOptions

    skip = tuple(m.strip() for m in (args.quant_skip_modules or "").split(",") if m.strip())
    return QuantizeOptions(args.quantize, double_quant=args.double_quant, compute_dtype=args.quant_compute_dtype, skip_modules=skip)
