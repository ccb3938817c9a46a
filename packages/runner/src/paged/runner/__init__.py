"""paged.runner."""
