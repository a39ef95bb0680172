"""What tests the sandboxes, never imported by a run: fault injection at the provider seam and the check
that no process is left behind."""
