"""tools: the `kvstore` operator CLI and the benchmarks (thin wrappers over the packages)."""
