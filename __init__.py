"""DSpark drafter sidecar: a TP-4 gRPC service serving MiniMax-M3.1 DSpark draft steps."""

__version__ = "0.1.0"
