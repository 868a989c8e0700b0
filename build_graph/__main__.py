from build_graph.launch import run

run()
