"""The sidecar's gRPC contract: sidecar.proto, its committed generated stubs, and the tensor codec."""

# The fully qualified service name, used by health checks and reflection. Spelled out (rather
# than read from the stubs' descriptor) so importing the package stays free of protobuf.
SERVICE_NAME = "dspark.sidecar.v1.DrafterSidecar"
# The initial-metadata key under which DraftSteps names the server instance that took the stream
# (StatusReport.instance): a client tells a stream that reached a restarted sidecar from one that reached
# the process whose status it read.
INSTANCE_METADATA = "dspark-instance"
# The one message of a lease connection (StatusReport.lease_socket): the sidecar's token, uint64 little-endian,
# never 0. struct's format, so that importing the package stays free of protobuf.
LEASE_TOKEN_FORMAT = "<Q"
# Leases one sidecar rank holds at once (server/lease.py): past them a connection is closed before its token, which
# the engine's warning names (client/lease.py). An engine rank needs one (two across a re-connect); each holds a
# descriptor of the rank's, so a client that only connects could otherwise use them all up.
MAX_LEASES = 16
