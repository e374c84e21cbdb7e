"""The parts of ``bench/flow.py``: one module per system, the producer process, a run."""
