"""Several implementations per op: definitions, implementations, the router, traces, check and tune."""
