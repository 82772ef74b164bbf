"""KV cache memory: page pool and block tables, page states, the prefix cache and its reuse."""
