"""KV cache memory: page pool and block tables (prefix index comes later)."""
