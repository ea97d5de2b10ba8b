"""``hf-merge merge SOURCE TARGET``: also accepts verl's ``model_merger`` spellings."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..errors import redact_credentials
from ..progress import count, human_bytes
from ._args import dtype_arg, float_dtype_arg, positive_int, size_arg

from ._formats import add_backend_argument, add_source_option_arguments, source_options

logger = logging.getLogger("hf_merge.cli")

EXAMPLES = """examples:
  hf-merge merge checkpoints/global_step_100/actor ./merged
  hf-merge merge checkpoints/ ./merged --dtype bfloat16 --max-shard-size 2GB
  hf-merge merge checkpoints/ ./merged-nf4 --quantize nf4 --double-quant   # bitsandbytes 4-bit
  hf-merge merge checkpoints/ ./gguf --gguf q8_0                           # one GGUF file for llama.cpp
  hf-merge merge --backend fsdp --local_dir checkpoints/global_step_100/actor --target_dir ./merged   # verl's spelling
"""

# verl flags that change nothing here, with the reason shown once when given.
IGNORED_VERL_FLAGS = {
    "use_cpu_initialization": "--use_cpu_initialization changes nothing: hf-merge never builds the model to merge",
    "trust_remote_code": "--trust-remote-code changes nothing: hf-merge reads config.json as JSON and copies remote-code files without running them",
    "tie_word_embedding": "--tie-word-embedding changes nothing: tied weights follow tie_word_embeddings in config.json",
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
    p.add_argument("target", nargs="?", help="output folder, written atomically; one holding only config/tokenizer "
                   "files (verl's actor/huggingface) is merged into, its files kept")
    p.add_argument("--local_dir", "--local-dir", dest="local_dir", help="verl spelling of SOURCE")
    p.add_argument("--target_dir", "--target-dir", dest="target_dir", help="verl spelling of TARGET")
    add_backend_argument(p)
    p.add_argument(
        "--dtype",
        default=None,
        type=dtype_arg,
        metavar="{float32,bfloat16,float16,auto}",
        help="output dtype (aliases fp32, bf16, fp16); default: the dtype in the checkpoint's config.json; "
        "auto: keep the shards' dtype",
    )
    p.add_argument("--max-shard-size", default=None, type=size_arg, metavar="SIZE",
                   help="largest output file: 5GB, 2G, 500MB, 4GiB or a byte count; default: the installed "
                   f"transformers' save_pretrained default{_shard_default()}, so the files are cut where it cuts them")
    p.add_argument("--workers", type=positive_int, default=None, help="processes writing output files (default: one per file, one per CPU, at most 8)")
    p.add_argument("--dist-writers", choices=("node", "rank"), default=None,
                   help="under torchrun: which ranks write the files: node (default: one process per node, with "
                   "forked writers on its CPUs) or rank (every rank writes a share)")
    p.add_argument("--config", "--hf_model_path", "--hf-model-path", dest="config", help="folder with config.json and tokenizer, if the checkpoint has no huggingface/ folder")
    p.add_argument("--trust-remote-code", action="store_true", help="verl compatibility; changes nothing: hf-merge never runs checkpoint code")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty target folder")
    p.add_argument("--is-value-model", action="store_true", default=None,
                   help="write a critic's value head as score.weight (Megatron; detected from the head's shape otherwise)")
    p.add_argument("--tie-word-embedding", action="store_true", help="verl compatibility; changes nothing: ties follow config.json")
    p.add_argument("--use_cpu_initialization", "--use-cpu-initialization", action="store_true",
                   help="verl compatibility; changes nothing: hf-merge never builds the model")
    add_source_option_arguments(p)
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
    hub.add_argument("--private", action=argparse.BooleanOptionalAction, default=None, help="create the repo private / public (an existing repo of the other visibility is refused)")
    p.add_argument("--verify", action="store_true", help="re-read the output and compare it with the source before finishing")
    p.add_argument("--checksum", dest="checksums", choices=["crc32", "sha256", "none"], default=True,
                   help="checksum of each output file recorded in hf_merge.json for `hf-merge verify` (default: crc32; "
                        "sha256 with --push-to-hub, whose upload needs it)")
    p.add_argument("--no-checksums", dest="checksums", action="store_const", const=False, help="the same as --checksum none")
    p.add_argument("--no-source-crc", dest="source_crc", action="store_false",
                   help="do not check the CRC-32 of the source's zip records as they are read (on by default; see docs/integrity.md)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    # app.main moves -q to the front wherever it is; listed here so that --help shows it (no default:
    # the top-level value stands)
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="anywhere on the line: warnings and errors only, no notes or progress bars")
    q = p.add_argument_group("quantized output (needs bitsandbytes: pip install bitsandbytes)")
    q.add_argument("--quantize", choices=["nf4", "fp4", "int8"], default=None, help="write bitsandbytes 4-bit (nf4, fp4) or 8-bit (int8) weights, as transformers saves them")
    q.add_argument("--double-quant", action="store_true", help="4-bit: quantize the scales too (bnb_4bit_use_double_quant)")
    q.add_argument("--quant-compute-dtype", type=float_dtype_arg, metavar="{float32,bfloat16,float16}", default=None, help="4-bit: bnb_4bit_compute_dtype (default: the output dtype)")
    q.add_argument("--quant-skip-modules", default=None, metavar="M1,M2", help="comma-separated modules to keep unquantized, besides lm_head and tied embeddings (llm_int8_skip_modules matching)")
    g = p.add_argument_group("GGUF output for llama.cpp (needs: pip install 'hf-merge[gguf]')")
    g.add_argument("--gguf", metavar="TYPE", default=None,
                   help="write a GGUF file instead of safetensors: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1; "
                        "k-quants (q4_k_m, q5_k_m, q6_k, ...) need llama-cpp-python")
    g.add_argument("--gguf-pre-tokenizer", metavar="NAME", default=None,
                   help="llama.cpp pre-tokenizer name (gpt-2, llama-bpe, qwen2, ...) when the tokenizer's hash is unknown")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ..errors import HfMergeError
    from ..write.distributed import launched_by_torchrun
    from ..preflight import check_merge

    if args.local_dir and args.source and not args.target and not args.target_dir:
        args.source, args.target = None, args.source  # `merge --local_dir X ./merged`: the one positional is TARGET
    source = args.source or args.local_dir
    target = args.target or args.target_dir
    if args.source and args.local_dir and args.source != args.local_dir:
        raise HfMergeError("both SOURCE and --local_dir given; pass one")
    if not source or not target:
        raise HfMergeError("need a SOURCE and a TARGET: hf-merge merge SOURCE TARGET (or --local_dir X --target_dir Y)")
    if not launched_by_torchrun():  # a rank of a distributed merge reports to the others instead
        check_merge(source, target, overwrite=args.overwrite, backend=args.backend, config=args.config,
                    base_model=args.base_model, quantize=args.quantize)  # before torch is imported
    for message in unused_options(args, torchrun=launched_by_torchrun()):
        logger.info(message)
    options = merge_options(args)
    with _head_start(args, source, target, options) as head:  # the first file written while torch is imported
        from ..merging import run as merge

        result = merge(source, target, options, head=head)
    if result.rank != 0:  # a distributed merge reports once, from rank 0
        return 0
    if args.json:
        adapter = {**result.adapter, "path": str(result.adapter["path"])} if result.adapter else None
        print(redact_credentials(json.dumps({
            "target": str(result.target), "files": result.files, "dtype": result.dtype, "quantization": result.quantization,
            "tensors": result.num_tensors, "bytes": result.total_bytes, "adapter": adapter, "notes": result.notes,
            "url": result.url,
        }, indent=2)))
    elif not getattr(args, "quiet", False):
        print(redact_credentials(summary_line(result)), file=sys.stderr)
        if result.url:
            print(f"pushed to {result.url}", file=sys.stderr)
    return 0


def unused_options(args: argparse.Namespace, *, torchrun: bool) -> list[str]:
    """One note for each option given that changes nothing in this merge (they were taken without a word)."""
    notes = [message for flag, message in IGNORED_VERL_FLAGS.items() if getattr(args, flag, False)]
    if args.dist_writers is not None and not torchrun:  # given, even as the default
        notes.append(f"--dist-writers {args.dist_writers} changes nothing without torchrun: this one process writes every file")
    if args.gguf is not None:
        for flag, given in (("--max-shard-size", args.max_shard_size), ("--workers", args.workers)):
            if given is not None:
                notes.append(f"{flag} changes nothing with --gguf: one GGUF file is written, by this process")
    elif args.gguf_pre_tokenizer is not None:
        notes.append("--gguf-pre-tokenizer changes nothing without --gguf: it names the tokenizer in a GGUF file")
    if args.private is not None and not args.push_to_hub:
        notes.append(f"--{'' if args.private else 'no-'}private changes nothing without --push-to-hub: nothing is uploaded")
    return notes


def summary_line(result) -> str:
    """``wrote TARGET (27 tensors, 1.23 GB, 1 file, dtype bfloat16)``, plus the adapter of a LoRA
    ``both`` merge, the quantization, and how to halve a float32 output."""
    files = count(len(result.files), "file")
    if (result.provenance.get("quantization") or {}).get("method") == "gguf":
        dtype = f"GGUF {result.quantization}"
    elif result.quantization:
        dtype = f"{result.quantization} (bitsandbytes), other tensors {result.dtype}"
    else:
        dtype = f"dtype {result.dtype}"
    kind = "the LoRA adapter " if (result.provenance.get("lora") or {}).get("mode") == "adapter" else ""
    line = f"wrote {kind}{result.target} ({result.num_tensors} tensors, {human_bytes(result.total_bytes)}, {files}, {dtype})"
    if result.adapter:
        a = result.adapter
        line += f" and its LoRA adapter {a['path']} ({a['tensors']} tensors, {human_bytes(a['bytes'])}, dtype {a['dtype']})"
    if result.dtype == "float32" and not result.quantization and not kind:
        line += "; float32 is exact, --dtype bfloat16 writes half the size"
    return line


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


def _shard_default() -> str:
    """`` (50GB)``: save_pretrained's default as read from transformers' source (no import), if it can be."""
    from ..write.shard_size import default_from_transformers_source

    found = default_from_transformers_source()
    return f" ({found})" if found is not None else ""


def merge_options(args: argparse.Namespace):
    """The command line's :class:`~hf_merge.options.MergeOptions` (built once per run)."""
    from ..options import MergeOptions

    return MergeOptions(
        backend=args.backend,
        dtype=args.dtype,
        max_shard_size=MergeOptions.max_shard_size if args.max_shard_size is None else args.max_shard_size,
        workers=args.workers,
        dist_writers=args.dist_writers or MergeOptions.dist_writers,
        config=args.config,
        overwrite=args.overwrite,
        lora=args.lora,
        lora_alpha=args.lora_alpha,
        use_rslora=args.use_rslora,
        base_model=args.base_model,
        base_model_name=args.base_model_name,
        verify=args.verify,
        checksums=args.checksums,
        source_crc=args.source_crc,
        quantize=_quantize_options(args),
        push_to_hub=args.push_to_hub,
        private=args.private,
        is_value_model=args.is_value_model,
        source_options=source_options(args),
        gguf=args.gguf,
        gguf_pre_tokenizer=args.gguf_pre_tokenizer,
    )


def _head_start_format(source: str, backend: str) -> str | None:
    """The format the merge will read ``source`` as, when a head start serves it
    (:data:`~hf_merge.write.head_start.FORMATS`), decided as the registry decides it and without
    importing torch: ``--backend`` names it, or (``auto``) it is the first format whose marks are
    there and whose probe matches. None otherwise, and when a format ranked above it could not
    be probed without torch."""
    import importlib

    from ..readers.formats import canonical, candidates
    from ..write.head_start import FORMATS

    # the served formats' probes import no torch; each module is imported only when its format is a candidate
    path = Path(source)
    for name in [canonical(backend)] if backend != "auto" else [d.name for d in candidates(path)]:
        if name not in FORMATS:
            return None
        try:
            if importlib.import_module(f"hf_merge.readers.{FORMATS[name]}").probe(path):
                return name
        except (OSError, ValueError):  # as the registry's probing takes it: not this format
            continue
    return None


def _head_start(args: argparse.Namespace, source: str, target: str, options):
    """The merge's head start (:mod:`hf_merge.write.head_start`) where it may apply, else a no-op context."""
    import contextlib

    from ..write.distributed import launched_by_torchrun

    plain = (
        args.gguf is None and args.quantize is None and args.base_model is None
        and not any(source_options(args).values()) and not launched_by_torchrun()
    )
    form = _head_start_format(source, args.backend) if plain else None
    if form is not None:
        from ..write.head_start import Request, begin

        head = begin(Request(source, target, options, form))
        if head is not None:
            return head
    return contextlib.nullcontext()
