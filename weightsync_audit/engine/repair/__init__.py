"""Making replicas equal again: resync, its plan and its transfers."""
