"""paged.multimodal."""
