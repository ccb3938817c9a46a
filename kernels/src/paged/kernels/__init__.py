"""paged.kernels."""
