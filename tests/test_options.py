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
