#!/usr/bin/env bash
# Create the DeepSpeed venv that bench_deepspeed.py and the fixture scripts under
# tests/data/deepspeed*/ need (deepspeed is not a test dependency: the tests read committed files).
#
#   bash benchmarks/setup_deepspeed.sh [VENV_DIR]      (default: /work/venv-ds; then DS_VENV=VENV_DIR)
#
# torch is pinned to the CPU 2.13.0 build pip is configured with here, installed first so that
# deepspeed cannot swap in another build; transformers as the fixtures were made (versions.json).
# The first DeepSpeed run on CPU compiles a small op (minutes; run it `nice`). Idempotent.
set -euo pipefail
VENV="${1:-/work/venv-ds}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.deepspeed-0.19.8-installed"

check() {
    DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'PY' 2>/dev/null
import deepspeed, torch, transformers
assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
assert not torch.version.cuda, torch.__version__
print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
}

if [[ -f "$STAMP" ]] && check >/dev/null; then
    echo "DeepSpeed venv already set up: $VENV ($(check))"
    exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install() {
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install "torch==2.13.0"
pip_install "torch==2.13.0" "deepspeed==0.19.8" "transformers==5.24.0" safetensors
check
touch "$STAMP"
echo "DeepSpeed venv ready: $VENV"
