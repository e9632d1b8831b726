"""Rollouts through SGLang's HTTP API, the client side: requests, a pool of engines, engine processes (mpo's own
engine is `mpo.engine`; weight sync is `mpo.weight_sync`)."""
