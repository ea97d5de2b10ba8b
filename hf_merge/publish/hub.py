"""Push a merged model or adapter folder to the Hugging Face Hub, with its model card.

:func:`push` checks that the folder is complete before touching the network, writes (or
extends) ``README.md`` from the provenance record ``hf_merge.json`` (see :mod:`hf_merge.publish.card`),
then calls ``HfApi.create_repo(..., exist_ok=True)`` and ``HfApi.upload_folder``.

A push replaces the model in the repo: the same commit deletes the model/adapter payload of an
earlier upload that this folder does not have (see :func:`stale_files`: old weights, shard
indexes, configs, ``lora_adapter/``...), so ``from_pretrained`` of the repo never meets the old
weights. README.md, ``.gitattributes`` and the user's other files are kept.

Why ``upload_folder`` (and not ``upload_large_folder``):

- In huggingface_hub 2.x with ``hf_xet`` installed (the default), ``upload_folder`` *is* the
  resumable upload: a pipelined, multi-commit upload where an interrupted run is resumed by
  running it again (files already committed are skipped by comparing object ids, chunks already
  uploaded are deduplicated by the Xet backend). ``upload_large_folder`` no longer exists there.
- Without ``hf_xet`` (or with ``HF_HUB_DISABLE_XET=1``) it is one atomic commit: an interrupted
  push leaves the branch unchanged, and a rerun sends only the files whose content differs from
  the branch (the Hub's preupload answer carries each remote file's id; unchanged files are
  dropped, and a rerun with nothing left to send makes no empty commit).
- ``upload_large_folder`` (huggingface_hub < 2) writes resume state into ``TARGET/.cache``, takes
  no commit message, and cannot open a pull request; our folders are a few files, not thousands.

Tokens: never passed around by hf_merge unless the caller gives one; huggingface_hub resolves
``HF_TOKEN`` or the ``hf auth login`` token itself. No message or log line here contains it.

Errors: every huggingface_hub / network failure becomes a one-line :class:`~hf_merge.errors.HubError`
(the original exception chained as ``__cause__``), see :func:`_hub_errors`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import HubError, folded, redact_credentials
from ..write.atomic import PROVENANCE_FILE
from .card import TMP_PREFIX, card_text, write_card

__all__ = ["push", "check_folder", "write_card", "PROVENANCE_FILE"]

logger = logging.getLogger(__name__)

_MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_LOGIN_HINT = "run `hf auth login` or set HF_TOKEN"

# What an earlier upload of a model or adapter left at the repo's root and a push replaces.
_PAYLOAD_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".index.json")
_PAYLOAD_NAMES = frozenset({"config.json", "generation_config.json", "adapter_config.json", PROVENANCE_FILE})
_PAYLOAD_FOLDERS = ("lora_adapter/",)
# Tokenizer / processor files are replaced only by an upload that carries some: they are also
# added by hand (``tokenizer.push_to_hub``) to repos whose merges have none.
_TOKENIZER_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json",
})
_TOKENIZER_FOLDERS = ("additional_chat_templates/",)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def push(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    token: str | None = None,
) -> str:
    """Upload a model or PEFT adapter folder to a Hub model repo, creating the repo if needed.

    Args:
        folder: the folder ``hf-merge merge`` wrote (``config.json`` + weights, or
            ``adapter_config.json`` + adapter weights).
        repo_id: ``namespace/name`` (``name`` alone means your own namespace).
        private: create the repo private (True) or public (False); None leaves the Hub default.
            An existing repo keeps its visibility: ``private=True`` on an existing public repo,
            or ``private=False`` on an existing private one, is refused before anything is uploaded.
        revision: branch to push to; created from the default branch when missing.
        commit_message: commit title; a default naming hf-merge is used when None.
        create_pr: open a pull request against the default branch instead of committing to it.
        token: a Hub token; None lets huggingface_hub resolve ``HF_TOKEN`` / ``hf auth login``.

    The commit also deletes the model/adapter files of an earlier upload that ``folder`` does not
    have (:func:`stale_files`), so the repo holds this model only; one log line counts them.

    Returns:
        The URL of the repo (of the branch when ``revision`` is given, of the pull request when
        ``create_pr`` opened one).

    Raises:
        HubError: the folder is incomplete, the arguments conflict, or the Hub refused or could
            not be reached; the message says which and what to do.
    """
    folder = Path(folder)
    kind = check_folder(folder)
    _check_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise HubError(
            f"--create-pr opens a pull request against the default branch, so --revision {revision!r} "
            "cannot be used with it: drop one of them"
        )
    info = _read_provenance(folder)
    if info is not None:
        _check_card(folder, info, kind=kind, repo_id=repo_id)
        if (info.get("verification") or {}).get("passed") is False:
            logger.warning("%s: the merge's verification failed; the model card says so", folder)

    from huggingface_hub import HfApi  # lazily: importing huggingface_hub costs time

    api = HfApi(token=token)
    with _hub_errors(repo_id, revision, api.endpoint):
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        full_id = repo_url.repo_id or repo_id
        if private is not None:
            _check_visibility(api, full_id, private)
        if revision not in (None, "main") and not create_pr:
            _ensure_branch(api, full_id, revision)
        remote = api.list_repo_files(full_id, repo_type="model", revision=None if create_pr else revision)
        stale = stale_files(folder, remote)

    if info is not None:
        write_card(folder, info, kind=kind, repo_id=full_id)

    message = commit_message or _default_message(kind, info)
    with _hub_errors(full_id, revision, api.endpoint), reuse_digests(folder, info):
        commit = api.upload_folder(
            repo_id=full_id,
            folder_path=folder,
            repo_type="model",
            revision=revision,
            commit_message=message,
            create_pr=create_pr,
            ignore_patterns=[f"{TMP_PREFIX}*"],
            delete_patterns=[_glob_escape(name) for name in stale] or None,
        )
    logger.info("pushed %s to %s (%s)", folder, full_id, getattr(commit, "commit_url", commit))
    if stale:
        logger.info("%s: deleted %d file(s) of an earlier upload that %s does not have (%s)",
                    full_id, len(stale), folder, _names(stale))

    pr_url = getattr(commit, "pr_url", None)
    if pr_url:
        return str(pr_url)
    if create_pr:
        logger.info("nothing differs from the default branch of %s: no pull request was opened", full_id)
    base = str(repo_url).rstrip("/")
    return f"{base}/tree/{revision}" if revision not in (None, "main") else base


def check_folder(folder: Path) -> str:
    """Check that ``folder`` holds a complete model or adapter; return ``"model"`` or ``"adapter"``.

    Nothing is read beyond small JSON files: the checks are that the config exists, that the
    weights exist (every shard of an index), and that every file ``hf_merge.json`` lists exists.

    Raises:
        HubError: naming what is missing.
    """
    if not folder.is_dir():
        raise HubError(f"{folder} is not a folder: give the TARGET folder that `hf-merge merge` wrote")
    gguf_file = ((_read_provenance(folder) or {}).get("gguf") or {}).get("file")
    if gguf_file and _safe_name(gguf_file):  # gguf: a `merge --gguf` folder holds one .gguf file
        if not (folder / gguf_file).is_file():
            raise HubError(f"{folder} is incomplete: {gguf_file} is missing; re-run the merge")
        return "model"
    if (folder / "config.json").is_file():
        kind, weights, indexes = "model", _MODEL_WEIGHTS, _MODEL_INDEXES
    elif (folder / "adapter_config.json").is_file():
        kind, weights, indexes = "adapter", _ADAPTER_WEIGHTS, ()
    else:
        raise HubError(
            f"{folder} is neither a model nor an adapter folder: it has no config.json (model) and no "
            "adapter_config.json (PEFT adapter); push the TARGET folder that `hf-merge merge` wrote"
        )
    index = next((folder / name for name in indexes if (folder / name).is_file()), None)
    if index is not None:
        missing = [name for name in _index_files(index) if not (folder / name).is_file()]
        if missing:
            raise HubError(
                f"{folder} is incomplete: {index.name} lists {len(missing)} missing shard(s) "
                f"({_names(missing)}); re-run the merge"
            )
    elif not any((folder / name).is_file() for name in weights):
        raise HubError(
            f"{folder} has a {'config.json' if kind == 'model' else 'adapter_config.json'} but no weights: "
            f"expected {' or '.join(weights + indexes)}; re-run the merge"
        )
    info = _read_provenance(folder)
    if info is not None:
        listed = info.get("files") or {}
        missing = [name for name in listed if _safe_name(name) and not (folder / name).is_file()]
        if missing:
            raise HubError(
                f"{folder} is incomplete: {PROVENANCE_FILE} lists {len(missing)} file(s) that are not there "
                f"({_names(missing)}); re-run the merge"
            )
    return kind


def stale_files(folder: Path, remote: list[str]) -> list[str]:
    """The files of ``remote`` (a repo's file list) that pushing ``folder`` deletes.

    Those are the model/adapter payload of an earlier upload that ``folder`` does not have: at the
    root, weights (``*.safetensors``, ``*.bin``, ``*.gguf``, ``*.pt``/``*.pth``, TF/Flax weights),
    shard indexes, ``config.json``, ``generation_config.json``, ``adapter_config.json``,
    ``hf_merge.json``; everything under ``lora_adapter/``; the tokenizer/processor files when
    ``folder`` has a tokenizer or processor of its own. Never README.md, ``.gitattributes``,
    subfolders other than those, or any other file (LICENSE, images, code).
    """
    local = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    tokenizer = any(name in _TOKENIZER_NAMES or name.startswith(_TOKENIZER_FOLDERS) for name in local)

    def payload(name: str) -> bool:
        if name.startswith(_PAYLOAD_FOLDERS) or (tokenizer and name.startswith(_TOKENIZER_FOLDERS)):
            return True
        if "/" in name:
            return False
        return name.endswith(_PAYLOAD_SUFFIXES) or name in _PAYLOAD_NAMES or (tokenizer and name in _TOKENIZER_NAMES)

    return sorted(name for name in remote if name not in local and "\\" not in name and payload(name))


def _glob_escape(name: str) -> str:
    """``name`` as a ``delete_patterns`` entry (fnmatch) that matches that file alone."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _check_card(folder: Path, info: dict[str, Any], *, kind: str, repo_id: str) -> None:
    """Fail before any network call when the card cannot be rendered or written."""
    text, existing = card_text(folder, info, kind=kind, repo_id=repo_id)
    if text != existing and not os.access(folder, os.W_OK):
        raise HubError(
            f"cannot write {folder / 'README.md'} (folder not writable): make it writable, or add a README.md"
        )


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"invalid repo id {repo_id!r}: expected 'namespace/name' or 'name' ({folded(e)})") from e


def known_digests(folder: Path, info: dict[str, Any] | None) -> dict[str, tuple[int, bytes]]:
    """``{normalised path: (size, sha256)}`` of the files whose digest the merge recorded.

    Only files not modified after ``hf_merge.json`` was written count (the merge writes the
    weights first), so an edited file is hashed again rather than trusted."""
    files = (info or {}).get("files") or {}
    try:
        written = (folder / PROVENANCE_FILE).stat().st_mtime_ns
    except OSError:
        return {}
    known = {}
    for name, digest in files.items():
        if not isinstance(digest, str) or len(digest) != 64:
            continue
        path = folder / name
        try:
            st = path.stat()
            value = bytes.fromhex(digest)
        except (OSError, ValueError):
            continue
        if st.st_mtime_ns <= written:
            known[os.path.normpath(str(path))] = (st.st_size, value)
    return known


@contextmanager
def reuse_digests(folder: Path, info: dict[str, Any] | None) -> Iterator[None]:
    """Let huggingface_hub's upload take the sha256 the merge already computed.

    huggingface_hub (2.x) hashes every file it uploads through LFS once more before sending it
    (``UploadInfo.sha256``, computed lazily from the file; settable). Inside this context an
    ``UploadInfo`` made for a file listed in ``hf_merge.json`` (same size, not modified since)
    starts with that digest, so a multi-GB upload does not read every weight file twice.
    Versions without a settable digest are left alone.
    """
    known = known_digests(folder, info)
    try:
        from huggingface_hub import _commit_api
    except ImportError:  # pragma: no cover - private module moved: upload hashes as before
        yield
        return
    upload_info = getattr(_commit_api, "UploadInfo", None)
    if not known or upload_info is None or not hasattr(upload_info, "is_hashed"):
        yield
        return
    original = upload_info.__dict__["from_path"]

    def from_path(cls, path: str):
        made = original.__func__(cls, path)
        size_digest = known.get(os.path.normpath(path))
        if size_digest is not None and size_digest[0] == made.size and not made.is_hashed:
            made.sha256 = size_digest[1]
        return made

    upload_info.from_path = classmethod(from_path)
    try:
        yield
    finally:
        upload_info.from_path = original


def _read_provenance(folder: Path) -> dict[str, Any] | None:
    path = folder / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HubError(
            f"{path} cannot be read ({folded(e)}): re-run the merge, or delete it to push without a card"
        ) from e
    if not isinstance(info, dict) or not isinstance(info.get("files", {}), dict):
        raise HubError(
            f"{path} is not an hf-merge provenance record: re-run the merge, or delete it to push without a card"
        )
    return info


def _index_files(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubError(f"{index} is not a valid shard index ({folded(e)}): re-run the merge") from e
    bad = [name for name in names if not _safe_name(name)]
    if bad:
        raise HubError(f"{index} names shard files outside the folder ({_names(bad)}): re-run the merge")
    return names


def _safe_name(name: Any) -> bool:
    """A relative path inside the folder: no absolute paths, no ``..``."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def _default_message(kind: str, info: dict[str, Any] | None) -> str:
    source = (info or {}).get("source") or {}
    origin = ""
    if source.get("format"):
        origin = f" from {source['format']}" + (f" step {source['step']}" if source.get("step") is not None else "")
    return f"Upload {'LoRA adapter' if kind == 'adapter' else 'model'}{origin} merged with hf-merge"


def _check_visibility(api: Any, repo_id: str, private: bool) -> None:
    """A push never changes an existing repo's visibility, and never uploads against the one asked.

    ``private=True`` on a public repo must not publish anything; ``private=False`` on a private
    repo is not applied either: making a repo public exposes all its files, branches and history,
    a decision taken on the repo (``hf repos settings``), not as a side effect of an upload.
    """
    repo = api.repo_info(repo_id, repo_type="model")
    if private and getattr(repo, "private", None) is False:
        raise HubError(
            f"{repo_id} already exists and is public, but a private push was asked; nothing was uploaded: "
            f"make it private first (`hf repos settings {repo_id} --private`) or push with --no-private"
        )
    if not private and getattr(repo, "private", None) is True:
        raise HubError(
            f"{repo_id} already exists and is private, but a public push (--no-private) was asked; nothing was "
            f"uploaded: make it public first (`hf repos settings {repo_id} --public`) or push without --no-private"
        )


def _ensure_branch(api: Any, repo_id: str, revision: str) -> None:
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        api.repo_info(repo_id, repo_type="model", revision=revision)
    except RevisionNotFoundError:
        logger.info("creating branch %s in %s", revision, repo_id)
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


def _network_error_types() -> tuple[type[BaseException], ...]:
    """Connection/timeout errors of whichever HTTP client huggingface_hub uses (already imported)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        mod = sys.modules.get(module)
        for name in names:
            cls = getattr(mod, name, None) if mod is not None else None
            if isinstance(cls, type) and issubclass(cls, BaseException):
                types.append(cls)
    return tuple(types)


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, endpoint: str) -> Iterator[None]:
    """Turn huggingface_hub and network failures into one-line HubErrors (original chained)."""
    endpoint = redact_credentials(endpoint)  # a token in HF_ENDPOINT's user info is never echoed
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except HubError:
        raise
    except HfHubHTTPError as e:
        status = e.response.status_code if getattr(e, "response", None) is not None else None
        if status in (401, 403):
            raise HubError(f"not logged in or no write access to {repo_id} on {endpoint}: {_LOGIN_HINT}") from e
        if isinstance(e, RevisionNotFoundError):
            raise HubError(
                f"revision {revision or 'main'!r} not found in {repo_id} on {endpoint}: "
                "check --revision (a branch name), or leave it out to push to main"
            ) from e
        if isinstance(e, RepositoryNotFoundError) or status == 404:
            raise HubError(
                f"repository {repo_id} not found on {endpoint}: check the repo id (namespace/name) "
                f"and that your token may write to that namespace ({_LOGIN_HINT})"
            ) from e
        detail = folded(getattr(e, "server_message", None) or "")
        raise HubError(
            f"the Hub at {endpoint} answered HTTP {status}{': ' + detail if detail else ''}; "
            "try again: re-running the push skips what is already uploaded"
        ) from e
    except OfflineModeIsEnabled as e:
        raise HubError(f"HF_HUB_OFFLINE is set, so nothing can be pushed to {endpoint}: unset it and re-run") from e
    except _network_error_types() as e:
        raise HubError(
            f"cannot reach the Hub at {endpoint} ({type(e).__name__}): check the network connection "
            "and HF_ENDPOINT, then re-run the push"
        ) from e
    except ValueError as e:  # e.g. "Invalid metadata in README.md" from the Hub's YAML validation
        text = folded(e)
        if "README.md" in text:
            raise HubError(f"the Hub rejected README.md: {text}; fix its YAML header and re-run") from e
        raise HubError(f"upload to {repo_id} refused: {text}") from e
