"""Internals of :mod:`needle.checkpoint` (activation checkpointing); import from there."""
