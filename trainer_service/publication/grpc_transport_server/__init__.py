"""The server half of the `grpc` weight transport, whose client half (and the sink that takes the host copies served
here) is common/weights/grpc_transport.py; the framing both halves speak over TCP is common/weights/tcp_wire.py.

slices.py: a fetch request checked against the version the publisher holds and turned into slices, paced to
weights.max_serve_mb_s; what FetchSlices streams (publication/weight_service.py) and what the TCP data plane sends.
data_plane.py: that data plane (weights.data_plane=tcp), with its front door intake.py.

Why here and not in common/weights/ beside the client: it serves the trainer's state, the versions a WeightPublisher
(publication/publisher.py) holds, and announces its port in that publisher's manifests; only the trainer runs it. In
common/ it would need the publisher there too, or an interface made only so it could move: common/ holds what both
services or the transport registry use, and nothing of this is the samplers'.
"""
