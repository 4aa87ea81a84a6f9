"""KV transfer: KV connectors behind vLLM V1's interface (vllm/distributed/kv_transfer/kv_connector/v1).

A connector moves KV blocks between the engine's pool and somewhere else: a host-memory tier and a
disk tier (offloading/, `--kv-offloading-size`), another engine (prefill/decode hand-off). It has
two sides, as vLLM's: the SCHEDULER side (no torch) decides which blocks a request can load instead of
computing and which blocks to save, and tells the WORKER side (in the model runner's step) through
`SchedulerOutput.kv_connector_metadata`; the worker side reports back in
`ModelRunnerOutput.kv_connector_output`. The scheduler (tokenloom/core/scheduler.py) and the runner
(tokenloom/model/runner.py) hold their side as an attribute the engine sets; neither imports this room.

    base.py        KVConnectorBase_V1, KVConnectorRole, KVConnectorMetadata (vLLM's names)
    factory.py     a connector by its `kv_connector` name (--kv-transfer-config)
    block_copy.py  a block's bytes out of / into every per-layer KV tensor of the runner (dtype-agnostic)
    offloading/    the OffloadingConnector: host tier (bounded, LRU) and disk tier (bounded, LRU,
                   checksummed files that survive a restart)
    shared_storage.py  the SharedStorageConnector: prefill/decode hand-off through a shared directory,
                   vLLM's kv_transfer_params flow (the proxy: tokenloom/server/pd_proxy.py)
    socket_connector.py  the SocketConnector: the same hand-off over TCP (the decode engine fetches the
                   prompt's blocks from the prefill engine's kv_ip:kv_port; wire: socket_transport.py)
    background_load.py  asynchronous loads (load_async: WAITING_FOR_REMOTE_KVS) on a worker thread
"""
