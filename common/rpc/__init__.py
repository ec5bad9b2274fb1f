"""gRPC plumbing shared by every server and client: channels, message limits, tokens and TLS."""
