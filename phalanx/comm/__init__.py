"""Communication layer: collectives, buckets, compression, algorithms."""
