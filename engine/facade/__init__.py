"""The facade side: the Engine its clients hold, its request table, the dispatcher, the router and the snapshots (the client's process)."""
