"""The engine process: its step loop, its messages and channel to the server, the clients, and the shard worker."""
