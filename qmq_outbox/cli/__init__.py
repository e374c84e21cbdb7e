"""The SDK's own ``qmq`` subcommands: ``db``, ``outbox``, ``subject`` and ``transport`` (and
``qmq_outbox.compensator.cli``), on the ground helpers of ``qmq_cli``.

``qmq_cli.main`` composes them with the broker's and the reconciliation's into ``qmq``;
nothing here imports another part. ``failures`` adds the SDK's errors and drivers to the
ground's one-line failures.
"""
