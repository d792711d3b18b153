from tui_merger.cli import main

raise SystemExit(main())
