"""Placement algorithms (contiguous, eplb, ilp)."""
