"""Published weights: snapshots and manifests, the transport interface (transport.py), the transports and their registry (registry.py)."""
