"""The sidecar service: TP rank processes serving draft steps over gRPC, with health and metrics."""
