"""paged.server.engine: the engine core, its process loop, and the clients that reach it."""
