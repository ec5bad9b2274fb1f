"""Weight publication, as objects that each do one thing: the publisher numbers versions, puts them into the
transport's sink and switches the manifest (publisher.py); the samplers' reports are kept by a registry the publisher
owns (samplers.py); the WeightService serves both to samplers (weight_service.py); and the grpc transport's server
half sends the slices of held versions, over gRPC or the TCP data plane (grpc_transport_server/)."""
