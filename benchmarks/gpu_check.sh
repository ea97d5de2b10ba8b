#!/usr/bin/env bash
# The CUDA checks, as one prepared run on a machine with a GPU (see docs/loading.md):
#   bash benchmarks/gpu_check.sh OUT_DIR [OLD_CODE_DIR]
# 1. tests/test_device_fill.py (its CUDA cases: loads equal from_pretrained of the merge, logits equal);
# 2. a 2-layer Qwen2-7B-shaped verl FSDP checkpoint (3.1 GB bf16) and the same model as a generic DCP
#    folder; bench_load.py --device-map cuda on each: from_sharded_pretrained (this tree, and
#    OLD_CODE_DIR's if given) against from_pretrained of the merged folder, load + first forward.
set -uo pipefail
out=${1:?OUT_DIR}; old=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=python3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$out/env.txt"
timeout 150 $py -m pytest -q -p no:cacheprovider tests/test_device_fill.py 2>&1 | tail -15 | tee "$out/tests.txt"
work=/tmp/gpuwork; mkdir -p $work
SECONDS=0
$py benchmarks/make_synthetic_checkpoint.py $work/fsdp --layers 2 --world-size 4 > $work/make.log 2>&1 || { tail -20 $work/make.log; exit 1; }
$py benchmarks/make_synthetic_dcp.py $work/fsdp $work/dcp 2>&1 | tail -1
echo "fixtures written in ${SECONDS} s"
code=(); [ -n "$old" ] && code=(--code "old=$old")
for src in fsdp dcp; do
  echo "== $src, device_map cuda"
  timeout 200 $py benchmarks/bench_load.py $work/$src --workdir $work/load --device-map cuda --dtype bfloat16 --repeat 3 "${code[@]}" 2>&1 | tee "$out/bench_$src.txt" | tail -9
done
