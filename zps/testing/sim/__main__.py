from zps.testing.sim.cli import main

raise SystemExit(main())
