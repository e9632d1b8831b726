"""Weight sync, trainer -> engines, after each optimizer step: the protocol, told once here.

The trainer streams its TP/PP/EP shards bucket by bucket, with no full-model gather on any rank (at Qwen3-30B-A3B,
gathering every shard on every rank would move ~61 GB of pickles per rank per step). The rooms:

* plan.py: every rank computes one fixed plan from megatron's own sharding metadata (each ShardedTensor's global
  shape and offset; the metadata, never the data, is exchanged once).
  - Units: the HF mapping's units (mpo.models.hf_mapping: one layer slice, or one (layer, expert) slice, of one
    megatron tensor, plus the HF tensors it becomes), in the mapping's fixed order.
  - Senders: one rank per pipeline stage (the stage's lowest global rank). A unit belongs to the stage whose ranks
    hold it; its sender assembles it.
  - Pieces: the main-replica shards that intersect a unit, each held by exactly one rank of that stage (a TP peer's
    column/row slice, an EP peer's expert block). DP replicas send nothing.
  - Buckets: consecutive units of one sender, up to `bucket_bytes` of HF tensors (a larger unit gets its own).
* gather.py (WeightStreamer): holders send their pieces point to point to the sender (on the training device: NCCL on
  GPU, gloo on CPU), which receives them straight into the unit's tensor (or a landing buffer for non-contiguous row
  slices), maps the bucket to HF names and layouts (ModelMapping.to_hf) and hands it to the transport. A sender
  allocates two slots per sync and carves every unit out of them: bucket k+1's pieces land in one while bucket k is
  converted and pushed from the other (double buffering). Holders keep at most two buckets of sends in flight. Peak
  extra memory on any rank is two slots plus one bucket's conversion copies, whatever the model size (measured:
  `python -m mpo.bench weight_sync --sweep`). Same-host pieces on CPU (`sync.host_shared_memory`, default on when the
  training device is the CPU): gloo's only path between two processes of one host is TCP over loopback, several times
  slower than memcpy, so the sender's slots are shared-memory files (shared_memory.py) and same-host holders write their
  pieces straight into place, told by a small "go" message when the slot is free and answering "done".
* transports.py (the Transport base class, the TRANSPORTS registry, the one compatibility check, and WeightSync:
  one weight-update session) and one module per transport (transport_<name>.py, a Transport subclass registered
  once; a user's class plugs in as sync.transport=module:attr or path/to/file.py:attr): how a bucket reaches the
  engines, all inside SGLang's weight-update session (pause -> begin -> buckets -> end -> continue):
  - "tensor": the bucket in the HTTP body of /update_weights_from_tensor (wire.py: mpo's engine takes
    `mpo_safetensors`, SGLang a `flattened_bucket`, every dtype in one buffer);
  - "distributed": per sender, the sender (rank 0 of the group, hosting the rendezvous) and every engine rank join
    one process group (/init_weights_update_group; engine i's ranks start at 1 + the TP sizes of the engines before
    it); per bucket every engine gets /update_weights_from_distributed in a thread while the sender broadcasts the
    bucket packed into ONE buffer (wire.pack_bucket): one collective per bucket, whatever its tensors. When stages
    push at once and when they take turns (one collective at a time per engine): DistributedTransport.__init__;
  - "cuda_ipc" (GPU only): SGLang engines on the trainer's GPUs get a flattened bucket whose tensor (one buffer per
    bucket, every dtype) is a CUDA IPC handle: one handle per bucket;
  - "shm" (CPU, mpo engines on the trainer's host): a bucket in a shared slot travels as locators (`mpo_shm`); the
    engine copies the values out before it answers, so the sender may reuse the slot right after.
  Why every sender talks to the engines itself rather than forwarding to rank 0: at 32 GPUs with PP4 the stages'
  bytes leave from four NICs instead of converging on one, and no rank holds more than its buckets.
* relay.py (colocated on several trainer nodes, a same-host transport): each node's leader (its lowest trainer rank)
  receives the other nodes' buckets point to point and pushes them to its node's engines. "distributed" stays
  refused there (a GPU twice in one NCCL group).
* fp8.py: `rollout.engine_weights: fp8_block`: each sender converts its HF buckets into block-FP8 before pushing;
  mpo's engine dequantizes on load, and the sync reports the error it adds (sync_fp8_weight_rel_rmse).
* publisher.py (Publisher, made once per run in mpo.trainer.loop.run; it owns its rank's WeightSync and closes it):
  rank 0 holds the engines (EngineSet, in mpo.rollout.engines, which keeps no sync state; rank 0's WeightSync comes from
  transports.engine_set_sync) and opens the session on every engine before any bucket and closes it after every sender
  finished, so the new weights take effect at once; every other sender gets the engine URLs from rank 0 (one small
  broadcast per sync) and pushes with its own WeightSync (distributed: its own group, rendezvous at its address on the
  route to the engines). Versions are ints (the step; str(int) on the wire, SGLang's weight_version being a string). No
  rank keeps a copy of the weights: a local engine restarted between syncs is stale (no rollout work) until the next
  publish reaches it; one that died during a publish is restarted after it and streamed to once more; a sync-mode
  collect left with only stale engines has every rank publish again (mpo.trainer.distribute.Distributor.republish) and
  reruns its requests.
* verify.py: mpo's engine reports sha256 over (name, per-tensor sha256) in name order. Each sender hashes the
  tensors it pushed as the engine stores them (engine dtype); only the name -> digest map meets on rank 0, which
  compares the combined checksum with every engine's. SGLang has no checksum for MoE models: the engines'
  log-probs of a probe covering every expert of every MoE layer are compared with the trainer's.
"""
