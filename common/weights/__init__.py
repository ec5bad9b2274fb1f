"""Published weights: snapshots and manifests, the transport interface (transport.py), the transports (chosen in common/registry/transports.py)."""
