"""What is audited: the manifest of tensors and which ranks hold a replica of each."""
