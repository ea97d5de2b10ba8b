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
