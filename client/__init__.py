"""The engine side: the shim that forwards eligible draft steps to its sidecar rank, its harness, demo and vLLM plug-in."""
