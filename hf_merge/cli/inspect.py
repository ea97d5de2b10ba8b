"""``hf-merge inspect SOURCE``: what a checkpoint holds, from metadata only (no tensor data read).

Prints a readable table; ``--json`` prints the same facts as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import redact_credentials
from ._formats import add_backend_argument, add_source_option_arguments, source_options

EXAMPLES = """examples:
  hf-merge inspect checkpoints/                    # the newest step's actor/
  hf-merge inspect checkpoints/global_step_100/actor --tensors
  hf-merge inspect megatron_ckpt/actor --source-names  # each HF tensor <- its Megatron tensor
  hf-merge inspect checkpoints/ --json | jq .world_size
  hf-merge inspect ds_run/ --tag global_step200     # a DeepSpeed tag other than `latest`
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="describe a checkpoint without reading tensor data",
        description="Describe a checkpoint from its metadata alone: format, world size, mesh, placements, dtypes, "
        "size, config and LoRA settings. No tensor data is read.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="checkpoint folder: actor/, global_step_N/, or the checkpoints root")
    add_backend_argument(p)
    p.add_argument("--config", "--hf_model_path", dest="config", help="folder with config.json, if the checkpoint has no huggingface/ folder")
    add_source_option_arguments(p)
    p.add_argument("--json", action="store_true", help="print the description as JSON (for scripts)")
    p.add_argument("--tensors", action="store_true", help="also list every tensor (name, shape, dtype, placement)")
    p.add_argument("--source-names", action="store_true",
                   help="list every tensor with the source tensor it is read from (the checkpoint's own name, stacked "
                        "index, split role), where a name table renames them (Megatron, torchtitan)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..describe import describe

    report = describe(args.source, backend=args.backend, config=args.config, tensors=args.tensors,
                      source_names=args.source_names, source_options=source_options(args))
    text = json.dumps(report, indent=2, default=str) if args.json else render(report)
    print(redact_credentials(text))
    return 0


def _placement(text: Any) -> str:
    """``"(Shard(dim=0),)"`` -> ``Shard(dim=0)``; ``"(Replicate(), Shard(dim=0))"`` -> ``Replicate(), Shard(dim=0)``."""
    text = str(text)
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1].rstrip(",")
    return text or "-"


def _mesh(report: dict[str, Any]) -> str | None:
    mesh, names = report.get("mesh"), report.get("mesh_dim_names") or []
    if not mesh:
        return None
    names = list(names) + [f"dim{i}" for i in range(len(names), len(mesh))]
    return " x ".join(f"{n}={s}" for n, s in zip(names, mesh))


def _lora(lora: Any) -> str:
    if not lora:
        return "none"
    if not isinstance(lora, dict):
        return "yes"
    from ..progress import human_bytes

    alpha = lora.get("lora_alpha")
    alpha_text = f"lora_alpha={alpha} (from {lora.get('alpha_source')})" if alpha is not None else f"lora_alpha not recorded ({lora.get('alpha_source')})"
    parts = [f"r={lora.get('r')}", alpha_text]
    if lora.get("use_rslora"):
        parts.append("rsLoRA")
    targets = (lora.get("target_modules") or []) + (lora.get("target_parameters") or [])
    parts.append(f"{lora.get('modules')} modules ({', '.join(targets)})")
    if lora.get("modules_to_save"):
        parts.append(f"modules_to_save {', '.join(lora['modules_to_save'])}")
    if lora.get("lora_only"):
        parts.append("LoRA weights only (save_lora_only: merge needs --base-model)")
    if lora.get("adapter_bytes") is not None:
        parts.append(f"adapter {human_bytes(lora['adapter_bytes'])}")
    return ", ".join(parts)


def render(report: dict[str, Any]) -> str:
    """The description as an aligned two-column table (plus the tensor list with ``--tensors``)."""
    from ..progress import human_bytes

    rows: list[tuple[str, str]] = []
    fmt = report.get("format")
    if report.get("fsdp_version"):
        fmt = f"{fmt} (FSDP{report['fsdp_version']})"
    if report.get("layout"):
        fmt = f"{fmt} ({report['layout']} layout)"
    rows.append(("format", str(fmt)))
    rows.append(("path", str(report.get("path"))))
    rows.append(("step", str(report["step"]) if report.get("step") is not None else "not recorded"))
    if report.get("world_size") is not None:
        rows.append(("world size", str(report["world_size"])))
    for key in ("tp", "pp", "ep"):
        if report.get(key) is not None:
            rows.append((key.upper(), str(report[key])))
    if report.get("model_kind"):
        rows.append(("model", str(report["model_kind"]) + (f" ({report['family']})" if report.get("family") else "")
                     + (" (critic: value head)" if report.get("value_model") else "")))
    elif report.get("family"):
        rows.append(("model family", str(report["family"]) + (" (critic: value head)" if report.get("value_model") else "")))
    if report.get("moe"):
        rows.append(("experts", str(report["moe"])))
    if mesh := _mesh(report):
        rows.append(("device mesh", mesh))
    if report.get("placements"):
        rows.append(("placements", "; ".join(_placement(p) for p in report["placements"])))
    if report.get("ranks_read") and report.get("world_size") and len(report["ranks_read"]) < report["world_size"]:
        rows.append(("ranks read", f"{', '.join(map(str, report['ranks_read']))} (the others are replicas)"))
    size = human_bytes(report.get("size_bytes") or 0)
    copies = report.get("tied_copies") or []
    tied = f"; {', '.join(copies)} stored again as a tied copy, not counted" if copies else ""
    rows.append(("tensors", f"{report.get('tensors_count')} ({report.get('parameters', 0):,} parameters, {size}{tied})"))
    dtypes = report.get("dtypes") or {}
    if isinstance(dtypes, dict) and dtypes:
        total = sum(dtypes.values()) or 1
        rows.append(("dtypes", ", ".join(f"{d} {100 * n / total:.0f}%" for d, n in sorted(dtypes.items(), key=lambda x: -x[1]))))
    if report.get("hf_config"):
        cfg = [str(report.get("architecture") or "unknown architecture")]
        if report.get("config_dtype"):
            cfg.append(f"dtype {report['config_dtype']}")
        cfg.append("tied embeddings" if report.get("tied_embeddings") else "untied embeddings")
        rows.append(("config", f"{report['hf_config']} ({', '.join(cfg)})"))
    else:
        rows.append(("config", "none found: merge needs --config DIR"))
    rows.append(("LoRA", _lora(report.get("lora"))))
    rows += [("note", str(n)) for n in report.get("notes") or []]
    rows += [("warning", str(w)) for w in report.get("warnings") or []]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    tensors = report.get("tensors") or []
    if tensors:
        name_w = max(len(t["name"]) for t in tensors)
        shape_w = max(len(str(tuple(t["shape"]))) for t in tensors)
        lines.append("")
        if "source" in tensors[0]:  # --source-names
            lines.append(f"{'tensor':<{name_w}}  {'shape':<{shape_w}}  {'dtype':<8}  source")
            for t in tensors:
                lines.append(f"{t['name']:<{name_w}}  {str(tuple(t['shape'])):<{shape_w}}  {t['dtype']:<8}  {t['source']}")
            return "\n".join(lines)
        lines.append(f"{'tensor':<{name_w}}  {'shape':<{shape_w}}  {'dtype':<8}  placement")
        for t in tensors:
            lines.append(f"{t['name']:<{name_w}}  {str(tuple(t['shape'])):<{shape_w}}  {t['dtype']:<8}  {_placement(t.get('placement') or '-')}")
    return "\n".join(lines)
