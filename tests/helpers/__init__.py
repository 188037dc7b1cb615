"""Shared test helpers: an independent float64 drafter, checkpoint fixtures and process spawning."""
