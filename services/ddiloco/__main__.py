from ddiloco.cli import main

raise SystemExit(main())
