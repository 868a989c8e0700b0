from build_graph.cli import run

run()
