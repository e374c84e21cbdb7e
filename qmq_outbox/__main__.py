from qmq_outbox.cli import main

main()
