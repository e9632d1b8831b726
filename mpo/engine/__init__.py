"""mpo's own inference engine: a server that speaks SGLang's HTTP API (generate, weight updates, memory release) over
the mpo model, for CPU rollouts, tests and the demo. The client side (requests, pools, engine processes) lives in
`mpo.rollout`; the engine imports only its wire types from there."""
