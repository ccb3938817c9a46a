"""paged.server."""
