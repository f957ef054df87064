"""Runnable examples of the service in a trainer's hands (not part of the installed package)."""
