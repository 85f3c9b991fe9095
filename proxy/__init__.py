"""admission-proxy: an admission-control reverse proxy for GPU inference replicas."""

__version__ = "0.1.0"
