"""Rollouts through SGLang's HTTP API, the client side: requests, a pool of engines, engine processes, and weight sync
(mpo's own engine is `mpo.engine`)."""
