"""The coordinator over gRPC: tree-structured exchanges between ranks (paper section 5.2), with a
per-job secret on every call, optional TLS, and a deadline on every exchange."""

from bcp.coord.grpc.coordinator import GrpcCoordinator
from bcp.coord.grpc.security import TlsConfig
from bcp.coord.grpc.topology import Tree

__all__ = ["GrpcCoordinator", "TlsConfig", "Tree"]
