"""How ranks talk during an audit: framed messages over a dedicated gloo group, every wait bounded."""
