"""A code-repair agent on `verifiers` driving `das serve` (see README.md)."""
