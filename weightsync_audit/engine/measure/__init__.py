"""How far apart: gaps against the reference copy, moved over the data plane, and tolerance."""
