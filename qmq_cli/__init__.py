"""The ``qmq`` command line: the helpers every part's commands stand on, and the command.

``options`` (click options from config dataclass fields) and ``failures`` (one line on
stderr and an exit code) import nothing of ``qmq_outbox``, ``qmq_broker`` or
``qmq_reconcile``, so each part builds its commands on them without depending on another
part. ``main`` is the ``qmq`` group at the top: it imports each part's own CLI module when
its subcommand runs (``tests/unit/test_import_layers.py`` holds both rules).
"""
