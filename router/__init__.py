"""The router process: gRPC front end of a pdserve cluster (no torch here, nor anything that imports it).

server (gRPC servicer, health, reflection) -> validation (request checks) -> workers (ZMQ sockets, liveness)
-> dispatch (least-loaded choice); stream (reorder TokenEvents, build responses) uses tokenizer (tokenizers +
Jinja chat templates, incremental detokenization, stop strings). requests holds the in-flight table, model_info
the model's limits, config the settings, client the `pdserve-client` command.
"""
