"""Rollouts through SGLang's HTTP API: the client, a pool of engines, mpo's own engine, and weight sync."""
