"""A KV page's state, one byte per page in a worker's snapshot (`WorkerView.page_states`).

Kept free of torch so the dashboard can import it without loading torch.
"""
FREE, USED, SHARED, CACHED = 0, 1, 2, 3   # cached: refcount 0, K/V kept for the prefix cache
STATE_NAMES = {FREE: "free", USED: "used", SHARED: "shared", CACHED: "cached"}
