"""End-to-end demo: a real 2-rank FSDP2 checkpoint -> ``hf-merge merge`` -> a Hugging Face model.

    .venv/bin/python examples/demo.py            (what ``make demo`` runs)

1. writes a tiny Qwen2 (built from a config, seeded) trained-free FSDP2 checkpoint with 2 gloo
   processes on CPU into demo_out/ckpt/ (verl layout), plus the unsharded fp32 reference model;
2. runs ``hf-merge merge demo_out/ckpt/global_step_1/actor demo_out/merged --overwrite``;
3. loads demo_out/merged with ``AutoModelForCausalLM.from_pretrained`` and checks it against the
   reference. The checkpoint holds fp32 parameters while its config says bfloat16, so the merged
   model is bf16 by default: every merged weight must be the fp32 reference weight after ONE
   bf16 rounding, and the merged logits must equal those of the reference rounded to bf16.
   Exits non-zero otherwise.

``--skip-merge`` checks an existing demo_out/merged without running the CLI.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path
from hf_merge.transformers_compat import dtype_kwargs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

BF16_REL_ULP = 2.0**-8  # one bf16 ulp relative to the value (8 significant bits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="demo_out", help="output folder, relative to the repo root")
    ap.add_argument("--skip-merge", action="store_true", help="check an existing OUT/merged only")
    args = ap.parse_args()

    import make_fsdp_checkpoint as mk

    out = Path(args.out)
    out_abs = out if out.is_absolute() else REPO / out
    ckpt, merged = out / "ckpt", out / "merged"
    actor = ckpt / "global_step_1" / "actor"

    # 1. the checkpoint ---------------------------------------------------------------------
    if not args.skip_merge:
        shutil.rmtree(out_abs / "ckpt", ignore_errors=True)
    if args.skip_merge and (out_abs / "ckpt" / "fixture.json").is_file():
        ck = mk.load_checkpoint_info(out_abs / "ckpt")
        print(f"[1/4] checkpoint : reusing {actor}")
    else:
        t0 = time.perf_counter()
        ck = mk.write_fsdp_checkpoint(out_abs / "ckpt", arch="qwen2", world_size=2, train_dtype="float32")
        print(
            f"[1/4] checkpoint : {actor}  (FSDP2 fully_shard, 2 gloo ranks on CPU, tiny Qwen2, fp32 "
            f"params, config dtype {ck.options['config_dtype']}; {time.perf_counter() - t0:.1f} s)"
        )
    print(f"      reference  : {ckpt / 'reference'}  (the unsharded fp32 model, save_pretrained)")

    # 2. the merge ----------------------------------------------------------------------------
    if not args.skip_merge:
        cmd = [sys.executable, "-m", "hf_merge.cli.app", "merge", str(actor), str(merged), "--overwrite"]
        print(f"[2/4] merge      : hf-merge merge {actor} {merged} --overwrite")
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        for line in (p.stdout + p.stderr).strip().splitlines():
            print(f"      | {line}")
        if p.returncode != 0:
            print(f"FAIL: hf-merge exited with status {p.returncode}")
            return p.returncode or 1
        print(f"      done in {time.perf_counter() - t0:.1f} s")
    else:
        print(f"[2/4] merge      : skipped (--skip-merge), checking {merged}")

    # 3. load and compare -----------------------------------------------------------------------
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged_abs = out_abs / "merged"
    model = AutoModelForCausalLM.from_pretrained(merged_abs, **dtype_kwargs("auto")).eval()
    ref = AutoModelForCausalLM.from_pretrained(ck.reference, **dtype_kwargs(torch.float32)).eval()
    ref_bf16 = AutoModelForCausalLM.from_pretrained(ck.reference, **dtype_kwargs(torch.bfloat16)).eval()
    print(f"[3/4] loaded     : {merged} as {type(model).__name__}, dtype {model.dtype}")
    ok = True
    if model.dtype != torch.bfloat16:
        print(f"FAIL: expected the config's dtype bfloat16 by default, got {model.dtype}")
        ok = False

    # weights: merged == fp32 reference after one bf16 rounding
    msd, rsd = model.state_dict(), ref.state_dict()
    if set(msd) != set(rsd):
        print(f"FAIL: tensor names differ: only merged {sorted(set(msd) - set(rsd))}, "
              f"only reference {sorted(set(rsd) - set(msd))}")
        return 1
    worst_name, worst = "", 0.0
    for k, r in rsd.items():
        err = ((msd[k].float() - r).abs() / r.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item()
        if err > worst:
            worst_name, worst = k, err
    exact = all(torch.equal(msd[k], rsd[k].to(msd[k].dtype)) for k in rsd)
    w_ok = worst <= BF16_REL_ULP
    print(f"      weights    : {len(rsd)} tensors; max |merged - fp32 ref| / |ref| = {worst:.3e} ({worst_name or '-'})"
          f"  bound: one bf16 rounding = 2^-8 = {BF16_REL_ULP:.3e}  -> {'OK' if w_ok else 'FAIL'}"
          f"{'  (bit-identical to ref.to(bfloat16))' if exact else ''}")
    ok &= w_ok

    # logits on the fixed inputs saved with the reference
    data = torch.load(ck.logits, weights_only=True)
    ids, ref_logits = data["input_ids"], data["logits"]
    with torch.no_grad():
        m_logits = model(input_ids=ids).logits.float()
        rb_logits = ref_bf16(input_ids=ids).logits.float()
    d_fp32 = (m_logits - ref_logits).abs().max().item()
    d_bf16 = (m_logits - rb_logits).abs().max().item()
    bound = BF16_REL_ULP * rb_logits.abs().max().item()
    l_ok = d_bf16 <= bound
    print(f"      logits     : input_ids {tuple(ids.shape)}, vocab {ref_logits.shape[-1]}, max |ref logit| = "
          f"{ref_logits.abs().max().item():.4f}")
    print(f"                   max |merged(bf16) - reference(fp32)|           = {d_fp32:.6f}  "
          "(bf16 weights + bf16 arithmetic; informational)")
    print(f"                   max |merged(bf16) - reference rounded to bf16| = {d_bf16:.6f}  "
          f"bound one bf16 ulp of the largest logit = {bound:.6f}  -> {'OK' if l_ok else 'FAIL'}")
    ok &= l_ok

    # 4. a few greedy tokens ----------------------------------------------------------------------
    tok_dir = merged_abs if (merged_abs / "tokenizer.json").is_file() else ck.hf_dir
    tok = AutoTokenizer.from_pretrained(tok_dir)
    prompt = "the water is"
    enc = tok(prompt, return_tensors="pt")
    gen_kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        m_out = model.generate(**enc, **gen_kw)[0, enc.input_ids.shape[1]:].tolist()
        r_out = ref_bf16.generate(**enc, **gen_kw)[0, enc.input_ids.shape[1]:].tolist()
    print(f"[4/4] generate   : greedy, prompt {prompt!r} (tokenizer from {tok_dir.name}/)")
    print(f"      merged     : {m_out}  {tok.decode(m_out)!r}")
    print(f"      reference  : {r_out}  {tok.decode(r_out)!r}  (reference rounded to bf16)")
    if m_out != r_out:
        print("FAIL: greedy tokens differ from the bf16-rounded reference")
        ok = False

    print("PASS: merged model matches the unsharded reference" if ok else "FAIL: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
