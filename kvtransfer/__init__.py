"""KV transfer between prefill and decode workers.

layout.py    the pool layout and the fingerprint compared at the handshake
pool.py      pool allocation (shared memory on CPU) used by the model runner
base.py      the source/sink contract: descriptors, head segments, pull handles
factory.py   which transport a pair uses, and a source or sink by transport name
shm.py       CPU transport over POSIX shared memory
cuda_ipc.py  CUDA transport over CUDA IPC handles
dist.py      cross-host transport over torch.distributed point-to-point
lease.py     the prefill side's leases on handed-off blocks
"""
