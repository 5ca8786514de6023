"""timers."""
