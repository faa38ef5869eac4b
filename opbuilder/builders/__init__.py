"""Builders of the built-in ops: a few declarative lines each."""
