"""Shared pytest fixtures: REAL verl FSDP checkpoints written by ``examples/make_fsdp_checkpoint.py``.

Every checkpoint fixture is session-scoped and lazy (built the first time a test asks for it) and
returns a :class:`make_fsdp_checkpoint.FsdpCheckpoint`::

    ck.root        checkpoint root (holds latest_checkpointed_iteration.txt, global_step_<i>/)
    ck.actor       root/global_step_<i>/actor        (rank files, fsdp_config.json, huggingface/)
    ck.hf_dir      ck.actor / "huggingface"
    ck.rank_files  [actor/model_world_size_<N>_rank_<r>.pt ...]
    ck.reference   root/reference: save_pretrained of the unsharded model, training dtype
                   (LoRA: the PEFT model's merge_and_unload())
    ck.logits      root/reference/logits.pt = {"input_ids": LongTensor[2, 8], "logits": float32}
    ck.reference_adapter / ck.reference_base   LoRA only: PEFT adapter folder / base before LoRA
    ck.base_model  save_lora_only only: HF folder of the base model, for ``--base-model``
    ck.placements  {key: "(Shard(dim=0))" | "(Replicate(), Shard(dim=0))" | "plain" ...}
    ck.options     what was asked for (arch, dtypes, world size, mesh, LoRA settings ...)

Set ``HF_MERGE_FIXTURE_CACHE=/some/dir`` to keep the checkpoints between sessions (keyed by a hash
of the generator's source and the torch / transformers / peft versions); by default they live in pytest's tmp dir. ``-v`` prints build times.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from hf_merge.transformers_compat import dtype_kwargs

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import make_fsdp_checkpoint as mk  # noqa: E402

# Tests compute every plan afresh (a test that patches transformers must not meet a cached plan);
# the plan cache's own tests point HF_MERGE_CACHE at a temporary folder.
os.environ["HF_MERGE_CACHE"] = "off"

FsdpCheckpoint = mk.FsdpCheckpoint
BUILD_TIMES: dict[str, float] = {}

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (writer, kwargs). One real multi-process run per entry.
CHECKPOINTS: dict[str, tuple] = {
    # FSDP2 fully_shard (per decoder layer, then root) on a 1-D ("fsdp",) mesh
    "qwen2_fp32_ws2": (mk.write_fsdp_checkpoint, dict(arch="qwen2", world_size=2)),
    "llama_tied_bf16_ws4": (
        mk.write_fsdp_checkpoint,
        dict(arch="llama", tie_word_embeddings=True, train_dtype="bfloat16", world_size=4),
    ),
    # embeddings / lm_head of 512 KB: rank pieces of whole pages, which from_sharded_pretrained maps
    "qwen2_vocab2k_ws2": (mk.write_fsdp_checkpoint, dict(arch="qwen2", world_size=2, vocab_size=2048)),
    "qwen2_shard1": (mk.write_fsdp_checkpoint, dict(arch="qwen2", world_size=2, shard_placement="first_divisible")),
    # distribute_tensor layouts
    "hsdp_ckpt": (mk.write_dtensor_checkpoint, dict(layout="hsdp")),
    "uneven_ckpt": (mk.write_dtensor_checkpoint, dict(layout="uneven")),
    "shard1_dtensor_ckpt": (mk.write_dtensor_checkpoint, dict(layout="shard1")),
    "ws1_ckpt": (mk.write_dtensor_checkpoint, dict(layout="ws1")),
    "mixed_buffers_ckpt": (mk.write_dtensor_checkpoint, dict(layout="mixed_buffers")),
    # the same layouts produced by FSDP2 itself (fully_shard on the 2-D / uneven / 1-rank mesh)
    "hsdp_fsdp2_ckpt": (mk.write_dtensor_checkpoint, dict(layout="hsdp", method="fully_shard")),
    "uneven_fsdp2_ckpt": (mk.write_dtensor_checkpoint, dict(layout="uneven", method="fully_shard")),
    "ws1_fsdp2_ckpt": (mk.write_dtensor_checkpoint, dict(layout="ws1", method="fully_shard")),
    # LoRA (PEFT wrapped before sharding, init_lora_weights=False so B != 0)
    "lora_ckpt": (mk.write_fsdp_checkpoint, dict(lora=dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS))),
    "lora_rslora_ckpt": (
        mk.write_fsdp_checkpoint,
        dict(lora=dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])),
    ),
    "lora_modules_to_save_ckpt": (
        mk.write_fsdp_checkpoint,
        dict(lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"])),
    ),
    "lora_only_ckpt": (
        mk.write_fsdp_checkpoint,
        dict(lora=dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS), save_lora_only=True),
    ),
    "lora_no_meta_ckpt": (
        mk.write_fsdp_checkpoint,
        dict(lora=dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]), lora_meta=False),
    ),
}


def _stack() -> bytes:
    """The libraries a fixture generator's output depends on, for the HF_MERGE_FIXTURE_CACHE keys
    (one cache shared by the main and the compatibility venvs must not hand one stack's fixtures to another)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    return " ".join(f"{n}={of(n)}" for n in ("torch", "transformers", "peft")).encode()


def _source_hash() -> str:
    return hashlib.sha256(Path(mk.__file__).read_bytes() + _stack()).hexdigest()[:12]


def build_checkpoint(name: str, tmp_path_factory) -> FsdpCheckpoint:
    """Build (or reuse from HF_MERGE_FIXTURE_CACHE) the checkpoint called ``name``."""
    writer, kwargs = CHECKPOINTS[name]
    cache = os.environ.get("HF_MERGE_FIXTURE_CACHE")
    if cache:
        root = Path(cache) / _source_hash() / name
        if (root / "fixture.json").is_file():
            BUILD_TIMES[name] = 0.0
            return mk.load_checkpoint_info(root)
    else:
        root = tmp_path_factory.mktemp(name, numbered=True)
    t0 = time.perf_counter()
    ck = writer(root, **kwargs)
    BUILD_TIMES[name] = time.perf_counter() - t0
    return ck


def _make_fixture(name: str):
    @pytest.fixture(scope="session", name=name)
    def _fixture(tmp_path_factory) -> FsdpCheckpoint:
        return build_checkpoint(name, tmp_path_factory)

    _fixture.__doc__ = f"REAL checkpoint {name}: {CHECKPOINTS[name][1]}"
    return _fixture


for _name in CHECKPOINTS:
    globals()[f"_fixture_{_name}"] = _make_fixture(_name)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint("hsdp_ckpt")`` -> the same object as the fixture of that name."""
    built: dict[str, FsdpCheckpoint] = {}

    def get(name: str) -> FsdpCheckpoint:
        if name not in built:
            built[name] = build_checkpoint(name, tmp_path_factory)
        return built[name]

    return get


class CliResult(NamedTuple):
    """Unpacks as ``rc, out, err``; also has ``.returncode/.stdout/.stderr`` like CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def run_hf_merge(*args: str | os.PathLike, timeout: float = 600, env: dict | None = None, cwd=None) -> CliResult:
    """Run the CLI in a fresh interpreter: ``python -m hf_merge.cli.app ARGS``."""
    cmd = [sys.executable, "-m", "hf_merge.cli.app", *map(str, args)]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)
    return CliResult(p.returncode, p.stdout, p.stderr)


@pytest.fixture
def run_cli():
    """``rc, out, err = run_cli("merge", src, dst, "--overwrite")``."""
    return run_hf_merge


def pytest_report_header(config):
    """The free disk where the fixtures are written: the suite needs about 0.5 GB there, and a full
    disk shows up as a torch.save failure inside a spawned fixture writer, not as a clear error."""
    import tempfile

    where = config.option.basetemp or tempfile.gettempdir()
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    return f"free disk under {where}: {free / 2**30:.1f} GiB" + ("  (under 1 GiB: fixtures may fail to write)" if free < 2**30 else "")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    if BUILD_TIMES and (config.option.verbose > 0 or os.environ.get("HF_MERGE_FIXTURE_TIMINGS")):
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in BUILD_TIMES.items())
        terminalreporter.write_line(f"fixture checkpoints built ({sum(BUILD_TIMES.values()):.1f}s): {parts}")


# --------------------------------------------------------------------------------------------
# Real megatron-core checkpoints (examples/make_megatron_checkpoint.py, 4 gloo ranks, TP=2 PP=2)
# --------------------------------------------------------------------------------------------

MEGATRON_GENERATOR = EXAMPLES / "make_megatron_checkpoint.py"
MEGATRON_MOE_GENERATOR = EXAMPLES / "make_megatron_moe_checkpoint.py"


def build_megatron_fixture(generator: Path, tmp_path_factory, name: str, *, depends: tuple[Path, ...] = ()) -> Path:
    """Run a megatron-core fixture generator once (cached under HF_MERGE_FIXTURE_CACHE, keyed by
    its source, megatron-core and torch); skip if megatron-core is not installed."""
    import torch

    mcore = pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")
    source = b"".join(p.read_bytes() for p in (generator, *depends))
    key = hashlib.sha256(source + mcore.__version__.encode() + torch.__version__.encode()).hexdigest()[:12]
    cache = os.environ.get("HF_MERGE_FIXTURE_CACHE")
    root = Path(cache) / f"{name}-{key}" if cache else tmp_path_factory.mktemp(name)
    done = root / "fixture.done"
    if done.is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log_path = root / "generator.log"
    # Output goes to a file (no pipe any straggler could hold open) and the generator runs in its
    # own process group, so that a failure or a timeout can end every process it started.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(generator), str(root)], stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of this run only
            except ProcessLookupError:
                pass
            proc.wait()
    if rc != 0:
        pytest.fail(f"{generator.name} failed (rc={rc}):\n{log_path.read_text()[-4000:]}")
    BUILD_TIMES[name] = time.perf_counter() - t0
    done.write_text(f"{BUILD_TIMES[name]:.1f}s\n")
    return root


@pytest.fixture(scope="session")
def megatron_root(tmp_path_factory) -> Path:
    """All default variants, written by real megatron-core (skips if it is not installed)."""
    return build_megatron_fixture(MEGATRON_GENERATOR, tmp_path_factory, "megatron")


@pytest.fixture(scope="session")
def megatron_moe_root(tmp_path_factory) -> Path:
    """MoE / MLA variants (EP=2 on 2 gloo ranks), written by real megatron-core."""
    return build_megatron_fixture(MEGATRON_MOE_GENERATOR, tmp_path_factory, "megatron-moe", depends=(MEGATRON_GENERATOR,))


class _ModelFolders(type(Path())):
    """A fixture folder of models (``root / name``) where ``/`` of a model the installed transformers
    could not build skips the test, saying why (``unbuilt``: set on a subclass per fixture)."""

    unbuilt: dict[str, str] = {}

    def __truediv__(self, key):
        if str(key) in self.unbuilt:
            pytest.skip(self.unbuilt[str(key)])
        return super().__truediv__(key)


def _hub_checkpoints(tmp_path_factory, name: str, models: list[str] | None) -> Path:
    """One 2-rank gloo run of ``examples/make_hub_checkpoints.py`` writing ``models`` (its default
    list when None) under a folder called ``name``, kept under HF_MERGE_FIXTURE_CACHE when set.

    Under transformers < 4.57 (the compatibility pass's oldest stack) the models it cannot build are
    left out, and a test that asks for one is skipped with the reason; from 4.57 on every model must build."""
    import make_hub_checkpoints as mh
    from hf_merge.transformers_compat import version_tuple

    models = list(models or mh.HUB_MODELS)
    unbuilt = mh.unbuildable(models) if version_tuple() < (4, 57) else {}
    key = hashlib.sha256(
        (EXAMPLES / "make_hub_checkpoints.py").read_bytes() + (EXAMPLES / "make_fsdp_checkpoint.py").read_bytes()
        + ",".join(sorted(unbuilt)).encode() + _stack()
    ).hexdigest()[:12]
    cache = os.environ.get("HF_MERGE_FIXTURE_CACHE")
    root = Path(cache) / f"{name}-{key}" if cache else tmp_path_factory.mktemp(name)
    if not (root / "fixture.json").is_file():
        mh.write_hub_checkpoints(root, [m for m in models if m not in unbuilt])
    return type(f"{name}_folders", (_ModelFolders,), {"unbuilt": unbuilt})(root)


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    """MoE / VLM models (and their LoRA variants) whose Hub layout differs from the in-memory one,
    written by ONE 2-rank gloo run of ``examples/make_hub_checkpoints.py``: ``hub_root / name``."""
    return _hub_checkpoints(tmp_path_factory, "hub", None)


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory) -> Path:
    """The model zoo of ``make_hub_checkpoints.ZOO`` (tied Qwen2 / Llama 3.2, Gemma 2 / 3, Qwen3,
    Mistral, Phi-3, GPT-OSS, LoRA on tied, fused-projection and MoE models): ``zoo_root / name``."""
    import make_hub_checkpoints as mh

    return _hub_checkpoints(tmp_path_factory, "zoo", list(mh.ZOO))


DCP_GENERATOR = EXAMPLES / "make_dcp_checkpoints.py"


@pytest.fixture(scope="session")
def dcp_root(tmp_path_factory) -> Path:
    """All four checkpoints, one 2-rank gloo run (cached under HF_MERGE_FIXTURE_CACHE)."""
    pytest.importorskip("torchtitan", reason="torchtitan is a test dependency (pip install -e '.[test]')")
    import accelerate
    import torch
    import torchtitan

    key = hashlib.sha256(
        DCP_GENERATOR.read_bytes() + f"{torch.__version__}{accelerate.__version__}{torchtitan.__version__}".encode()
    ).hexdigest()[:12]
    cache = os.environ.get("HF_MERGE_FIXTURE_CACHE")
    root = Path(cache) / f"dcp-{key}" if cache else tmp_path_factory.mktemp("dcp-formats")
    if (root / "fixture.json").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, str(DCP_GENERATOR), str(root)], capture_output=True, text=True, env=env, timeout=600)
        # A gloo rank of the writer has (rarely: once in this project's suite runs) aborted with the C++
        # runtime's "terminate called without an active exception"; that run is written again from
        # scratch once. Any other failure fails the fixture.
        if proc.returncode == 0 or attempt == 2 or "terminate called without an active exception" not in proc.stderr:
            break
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    if proc.returncode != 0:
        pytest.fail(f"make_dcp_checkpoints.py failed:\n{proc.stderr[-4000:]}")
    (root / "build_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return root


# The SentencePiece vocabulary of ``llama_sp_folder`` (test_gguf.py, test_gguf_vocab.py)
SP_LINES = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny sentencepiece model",
            "pack my box with five dozen liquor jugs", "sphinx of black quartz judge my vow",
            "numbers 0123456789 and punctuation .,;:!?", "a llama, a tokenizer and a merge tool walk into a bar"]


@pytest.fixture(scope="session")
def llama_sp_folder(tmp_path_factory) -> Path:
    """A tiny Llama-2-style Hugging Face folder: a SentencePiece BPE model with byte fallback
    trained here by the sentencepiece package (tokenizer.model), the tokenizer transformers builds
    from it plus an added special token (tokenizer.json / tokenizer_config.json, saved by
    transformers), and a tiny Llama whose vocabulary is larger than the tokenizer's."""
    import io

    import torch

    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf", reason="transformers converts a SentencePiece model with protobuf")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    folder = tmp_path_factory.mktemp("llama-sp") / "llama2-tiny"
    folder.mkdir()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_LINES * 20), model_writer=model, model_type="bpe", vocab_size=400, byte_fallback=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True, num_threads=1, minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}'
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, **dtype_kwargs(torch.float32)).save_pretrained(folder)
    return folder
