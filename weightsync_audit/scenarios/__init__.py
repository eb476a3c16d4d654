"""Real-world divergence scenarios, runnable and importable by tests, benchmarks and the demo."""
