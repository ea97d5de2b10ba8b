"""Transforms: lazy checkpoints built on lazy checkpoints. Nothing is read until a consumer asks."""

from .cast import Cast, cast_policy
from .hub_layout import HubLayout, hub_layout
from .rename import Renamed, drop_tied

__all__ = ["Cast", "HubLayout", "Renamed", "cast_policy", "drop_tied", "hub_layout"]
