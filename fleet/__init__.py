"""Fleet simulation: many virtual devices running the real client and coordinator over a real broker."""
