"""qmq broker: durable append-only logs served over HTTP.

Importing this package pulls in nothing of the server; ``qmq_broker.format`` reads the data
directory on its own (the Spark reconciliation uses it).
"""
