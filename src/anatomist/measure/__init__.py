"""Measurement of real runs."""
