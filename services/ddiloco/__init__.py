"""ddiloco: Decoupled DiLoCo, asynchronous low-communication training over gRPC."""

__version__ = "0.1.0"
