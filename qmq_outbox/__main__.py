from qmq_cli.main import main

main(prog_name="qmq")
