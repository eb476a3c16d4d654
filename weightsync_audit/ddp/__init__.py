"""DistributedDataParallel, the adapter: the trainable set its reducer was built over (inspect), re-creating
the wrapper when that set changes (rewrap), and the watch that notices the change (watch). What an audit
reads of a wrapper is the engine's (``engine/explain/evidence``), as are the hints that explain a
divergence (``engine/explain``)."""
