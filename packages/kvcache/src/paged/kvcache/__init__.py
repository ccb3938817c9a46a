"""paged.kvcache."""
