from build_graph.cli import main

raise SystemExit(main())
