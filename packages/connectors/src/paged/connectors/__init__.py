"""paged.connectors."""
