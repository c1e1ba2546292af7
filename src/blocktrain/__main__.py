from blocktrain.cli.main import main

raise SystemExit(main())
