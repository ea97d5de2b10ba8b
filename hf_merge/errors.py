"""Typed errors. Every error hf_merge raises on bad input derives from :class:`HfMergeError`.

The CLI maps each class to one ``error: ...`` line (see ``hf_merge/cli/_errors.py``); the message
itself must already say what is wrong *and* what to do about it.
"""

from __future__ import annotations

import re

# A Hub token is ``hf_`` and 34 letters; 30 or more letters and digits after a lower-case ``hf_`` is one,
# while ``hf_checkpoints/`` or ``HF_ENDPOINT`` in a path or message is not.
_CREDENTIALS = re.compile(r"(://)[^/\s@]*@|\b(hf_[A-Za-z0-9]{30,})\b|((?i:token|api_key|access_token)=)[^&\s]+")


def redact_credentials(text: str) -> str:
    """``text`` with credentials removed: URL user info (``https://user:TOKEN@host``),
    ``?token=...`` parameters and ``hf_...`` tokens."""
    return _CREDENTIALS.sub(
        lambda m: (m.group(1) + "***@") if m.group(1) else ("hf_***" if m.group(2) else m.group(3) + "***"), text
    )


# The CLI's options that messages name, as the Python API's keyword arguments (hf_merge.merge,
# from_sharded_pretrained): the same error raised to Python code names what that caller passes.
_PYTHON_SPELLING = {
    "--no-source-crc": "source_crc=False", "--no-checksums": "checksums=False", "--checksum": "checksums=",
    "--no-private": "private=False", "--tag": 'source_options={"tag": ...}',
    "--source-weights": 'source_options={"source_weights": ...}',
    **{f"--{flag}": f"{flag.replace('-', '_')}=True" for flag in ("overwrite", "verify", "use-rslora", "is-value-model",
                                                                   "private")},
}
_PYTHON_FIELDS = ("backend", "dtype", "max_shard_size", "workers", "config", "lora", "lora_alpha", "base_model",
                  "base_model_name", "quantize", "push_to_hub", "gguf", "gguf_pre_tokenizer", "dist_writers")
_PYTHON_SPELLING.update({"--" + f.replace("_", "-"): f + "=" for f in _PYTHON_FIELDS})
#: options whose value words are choices (``--lora fuse`` is ``lora="fuse"``)
_CHOICES = ("--lora", "--quantize", "--dtype", "--gguf", "--backend", "--dist-writers")
_CLI_ALIAS = re.compile(r" \(alias --[\w-]+\)")  # "--config DIR (alias --hf_model_path)": verl's spelling
_CLI_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: ([A-Z]+\b|[a-z0-9_]+\b))?")


def python_spelling(text: str) -> str:
    """``text`` with the CLI options it names spelled as keyword arguments (``--config DIR`` as
    ``config=DIR``, ``--lora fuse`` as ``lora="fuse"``, ``--no-source-crc`` as
    ``source_crc=False``); other text as it is."""
    def spelled(m: "re.Match[str]") -> str:
        option, value = m.group(1), m.group(2)
        keyword = _PYTHON_SPELLING.get(option)
        if keyword is None:
            return m.group(0)
        if value and value.isupper() and keyword.endswith("="):  # a placeholder: config=DIR
            return keyword + value
        if value and option in _CHOICES:
            return f'{keyword}"{value}"'
        if value and value.isupper():  # a placeholder the keyword already stands for: --tag TAG
            value = None
        return keyword + (f" {value}" if value else "")

    return _CLI_OPTION.sub(spelled, _CLI_ALIAS.sub("", text))


def for_python(function):
    """Decorator of a Python API function: an :class:`HfMergeError` it raises names keyword
    arguments instead of the CLI's options (:func:`python_spelling`)."""
    import functools

    @functools.wraps(function)
    def called(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except HfMergeError as e:
            if e.args and isinstance(e.args[0], str):
                e.args = (python_spelling(e.args[0]), *e.args[1:])
            raise

    return called


def folded(text: "str | BaseException") -> str:
    """``text`` on one line: each run of whitespace, newlines included, as one space."""
    return " ".join(str(text).split())


class HfMergeError(Exception):
    """Base class of all hf_merge errors."""

    exit_code = 2

    def __reduce__(self):  # unpickled whole whatever its __init__ takes (a forked writer sends it to the parent)
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type, args: tuple, state: dict) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class SourceNotFoundError(HfMergeError):
    """The source path does not exist or holds nothing hf_merge can read."""


class UnsupportedCheckpointError(HfMergeError):
    """The files exist but are not a layout hf_merge understands."""


class CorruptCheckpointError(HfMergeError):
    """A checkpoint file is truncated, garbage, or inconsistent with its siblings."""


class IncompleteStepError(CorruptCheckpointError):
    """The newest ``global_step_N`` of a checkpoints folder is empty or incomplete (a run stopped
    while saving it); the message names the newest complete step to pass instead."""


class UnsafeCheckpointError(HfMergeError):
    """A pickle asks for code outside the allowlist; nothing from it was executed."""


class MissingConfigError(HfMergeError):
    """No Hugging Face config.json could be found for the checkpoint."""


class TargetExistsError(HfMergeError):
    """The output folder exists and is not empty (use --overwrite)."""


class InsufficientSpaceError(HfMergeError):
    """The target's file system has less free space than the merge plans to write; nothing was written."""

    exit_code = 3


class MappingError(HfMergeError):
    """A tensor name or fused layout could not be mapped to the Hugging Face layout."""


class LoraError(HfMergeError):
    """LoRA settings are missing, inconsistent or unsupported."""


class QuantizationError(HfMergeError):
    """Quantized output was asked for but cannot be produced."""


class VerificationError(HfMergeError):
    """A merged output does not match what it was checked against."""

    exit_code = 1


class HubError(HfMergeError):
    """An interaction with the Hugging Face Hub failed."""


class DistributedError(HfMergeError):
    """A rank of a distributed (torchrun) merge failed, died or timed out; no target was written."""


class WriterDiedError(HfMergeError):
    """A forked writer process died without reporting an error (killed: the OOM killer, a signal);
    nothing was written to the target."""

    exit_code = 3


class PickleRefusedError(UnsafeCheckpointError):
    """The pickle allowlist refused something a pickle asks for (nothing from it ran). ``where`` is
    the file, ``what`` what it asked for; ``advice`` what to do (by default: re-save with plain
    tensors or convert it yourself, trusting it; a reader whose files hold only allowlisted things
    says instead that the file is damaged)."""

    RESAVE = ("Re-save the checkpoint with plain tensors, or only if you fully trust the file convert it "
              "yourself with torch.load(weights_only=False)")

    def __init__(self, where: str, what: str, advice: str = RESAVE):
        super().__init__(f"{where}: the pickle {what}, which is outside hf_merge's pickle allowlist; refused, "
                         f"nothing from it was run. {advice}")
        self.where, self.what = where, what


class PickleLimitError(UnsafeCheckpointError):
    """A pickle would cost work out of proportion to its size (nesting depth, memo size, hash cost);
    refused before anything was built."""
