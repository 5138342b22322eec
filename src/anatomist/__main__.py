from anatomist.cli import run

run()
