"""The systems and workloads of ``bench/peers.py``: one module per peer, shared drivers."""
