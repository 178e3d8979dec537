"""Test helpers: tiny seeded MoE models for every family in transformers (no downloads)."""

from moelens.testing import tiny
from moelens.testing.tiny import *  # noqa: F403 (the names in tiny.__all__)

__all__ = tiny.__all__
