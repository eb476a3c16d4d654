"""What is reported: the record (record), its strict validation (validate), the JSONL report (jsonl),
terminal rendering (render) and the picture (plot)."""
