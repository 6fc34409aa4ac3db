"""The wire between nodes: the versioned .proto, its codec, the gRPC client."""
