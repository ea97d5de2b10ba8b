"""Transforms: lazy checkpoints built on lazy checkpoints. Nothing is read until a consumer asks."""

from .cast import Cast, cast_policy
from .rename import Renamed, drop_tied

__all__ = ["Cast", "Renamed", "cast_policy", "drop_tied"]
