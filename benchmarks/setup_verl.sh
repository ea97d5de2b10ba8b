#!/usr/bin/env bash
# Create a separate venv with verl 0.9.1's model merger, for side-by-side benchmarks.
#
#   bash benchmarks/setup_verl.sh [VENV_DIR]      (default: bench_out/verl-venv)
#
# verl is installed with --no-deps (its full dependency set pulls vLLM/flash-attn/CUDA);
# only what `verl.model_merger` imports is added. torch is pinned to the CPU wheel that
# pip is configured with here — a CUDA torch is never pulled. Idempotent: a venv whose
# stamp matches and whose import check passes is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-bench_out/verl-venv}"
PYTHON="${PYTHON:-python3}"
VERL_VERSION="0.9.1"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.verl-$VERL_VERSION-installed"

check() {
    "$VENV/bin/python" - <<'PY'
import torch, transformers, verl
import verl.model_merger.fsdp_model_merger  # noqa: F401  (what `--backend fsdp` needs)
assert verl.__version__ == "0.9.1", verl.__version__
assert "+cpu" in torch.__version__ or not torch.version.cuda, torch.__version__
print(f"verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
}

if [[ -f "$STAMP" ]] && check >/dev/null 2>&1; then
    echo "verl venv already set up: $VENV ($(check))"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install() {
    # the local extra indexes here warn about every package they lack; hide that noise only
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade pip
# torch first and pinned, so that nothing below can swap in another build.
pip_install "torch==$TORCH_VERSION"
pip_install "torch==$TORCH_VERSION" \
    ray tensordict hydra-core codetiming dill pandas accelerate peft safetensors \
    "transformers>=5.5.3,<5.11" psutil numpy
pip_install --no-deps "verl==$VERL_VERSION"
check
touch "$STAMP"
echo "verl venv ready: $VENV"
