"""How ranks agree: the summary round, per-tensor majorities, structure and shard comparison."""
