"""Per-layer state: KV caches (and later recurrent states) and their persistence."""
