"""DistributedDataParallel: what its reducer covers (inspect), re-creating it (rewrap), and the hints
that explain a divergence from what it does."""
