"""A worker node: loaded stages, their KV caches, and the gRPC service around them."""
