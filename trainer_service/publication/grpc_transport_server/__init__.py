"""The server half of the `grpc` weight transport, whose client half (and the sink that takes the host copies served
here) is common/weights/grpc_transport.py; the framing both halves speak over TCP is common/weights/tcp_wire.py.

slices.py: a fetch request checked against the version the publisher holds and turned into slices, paced to
weights.max_serve_mb_s; what FetchSlices streams (publication/weight_service.py) and what the TCP data plane sends.
data_plane.py: that data plane (weights.data_plane=tcp), with its front door intake.py.

Why here and not in common/weights/ beside the client: it imports nothing of the trainer but serves the trainer's
state (the versions a WeightPublisher holds), and only the trainer runs it. common/ holds what both services or the
transport registry use; a server half there would be code that one service alone reaches across the boundary for.
"""
