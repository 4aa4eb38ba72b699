"""Test helpers shipped with deepinfer_ops: pure-torch references (``refs``) and comparison tiers (``compare``)."""

from . import compare, refs

__all__ = ["compare", "refs"]
