"""The ECZmqConnector: encoder outputs from an encoder-only producer to a consumer over ZMQ."""

from paged.connectors.ec.p2p.config import ECZmqConfig
from paged.connectors.ec.p2p.fetcher import EmbeddingFetcher, FetchResult
from paged.connectors.ec.p2p.server import EmbeddingServer

__all__ = ["ECZmqConfig", "EmbeddingFetcher", "EmbeddingServer", "FetchResult"]
