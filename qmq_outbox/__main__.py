from qmq_outbox.cli import main

main(prog_name="qmq")
