"""Shard groups and their launchers (processes, Ray) and the collectives backends use."""
