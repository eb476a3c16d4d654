"""Thin adapters over the engine: Lightning callbacks, zero-code activation, and other Trainers."""
