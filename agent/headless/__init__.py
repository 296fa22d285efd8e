"""Headless runs: one prompt or a script of steps, without the TUI."""
