"""``MergeOptions``: the one value the API, the CLI and the executors share."""

from __future__ import annotations

import dataclasses

import pytest

from hf_merge import MergeOptions, merge
from hf_merge.cli.app import build_parser
from hf_merge.cli.merge import merge_options


def test_merge_refuses_an_unknown_keyword_before_anything_is_read(tmp_path):
    with pytest.raises(TypeError, match="max_shard"):
        merge(tmp_path / "no-such-source", tmp_path / "out", max_shard="1GB")
    assert not (tmp_path / "out").exists()


def test_options_are_frozen_and_the_cli_builds_them_once():
    options = MergeOptions(dtype="bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = "float32"
    args = build_parser().parse_args(["merge", "src", "out", "--gguf", "q8_0", "--lora", "fuse", "--no-checksums",
                                      "--max-shard-size", "2GB", "--dist-writers", "rank"])
    got = merge_options(args)
    assert (got.gguf, got.lora, got.checksums, got.max_shard_size, got.dist_writers) == ("q8_0", "fuse", False, 2 * 10**9, "rank")


def test_the_checksum_kind_follows_the_flags():
    """A CRC-32 by default; a sha256 when the folder goes to the Hub (its upload needs one) or when
    asked; none with --no-checksums / --checksum none; an unknown kind is one typed error."""
    from hf_merge.errors import HfMergeError

    def kind(*flags: str) -> str | None:
        return merge_options(build_parser().parse_args(["merge", "src", "out", *flags])).checksum()

    assert kind() == "crc32"
    assert kind("--push-to-hub", "me/model") == "sha256"
    assert kind("--checksum", "sha256") == "sha256"
    assert kind("--checksum", "crc32", "--push-to-hub", "me/model") == "crc32"
    assert kind("--checksum", "none") is None and kind("--no-checksums") is None
    with pytest.raises(HfMergeError, match="md5"):
        MergeOptions(checksums="md5").checksum()
