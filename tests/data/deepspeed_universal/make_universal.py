"""Convert committed DeepSpeed fixtures to universal checkpoints with REAL ``ds_to_universal`` (run once, commit).

    DS_ACCELERATOR=cpu /work/venv-ds/bin/python tests/data/deepspeed_universal/make_universal.py

Needs deepspeed 0.19.x (``deepspeed.checkpoint.ds_to_universal``; versions in ../deepspeed/versions.json).
For each variant of ``../deepspeed/`` listed in :data:`VARIANTS` it runs

    python -m deepspeed.checkpoint.ds_to_universal --input_folder ../deepspeed/V/global_step2
        --output_folder V/global_step2_universal --inject_missing_state

which writes ``V/latest_universal`` and ``V/global_step2_universal/`` (``zero/<param>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``, ``zero/optimizer_state.pt`` and a copy of the
model_states files). ``--inject_missing_state`` adds the ``universal_checkpoint_info`` that
only Megatron-DeepSpeed clients save. The tests compare what hf-merge reads from these folders
with the trained masters of the source variant (``../deepspeed/V/reference/step2/masters.safetensors``).

Seen with 0.19.8 and left out: the stage-2 round-robin variant (``z2_fp32_rr_tied_ws3``, gradients
partitioned in round-robin order) converts without error but 23 of its 26 fp32.pt differ from the
trained masters.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "deepspeed"
VARIANTS = ("z1_bf16_tied_ws2", "z2_bf16_align_ws3", "z3_bf16_tied_ws2")


def main() -> None:
    for name in VARIANTS:
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(SOURCE / name / "global_step2"),
             "--output_folder", str(out / "global_step2_universal"), "--inject_missing_state",
             "--num_extract_workers", "1", "--num_merge_workers", "1"],
            check=True,
        )


if __name__ == "__main__":
    main()
