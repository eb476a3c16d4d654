"""How it is hashed: digests of tensor bytes, the cached digest plan, device digests, sampling."""
