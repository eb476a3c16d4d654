"""When: the audit history and the per-step pinpoint ring."""
