"""What is reported: the record (record), the JSONL report (jsonl), terminal rendering (render), the
picture (plot), and checkpoint comparison (checkpoint_diff)."""
