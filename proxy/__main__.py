"""``python -m proxy``: the same command line as ``admission-proxy``."""

from proxy.cli import main

raise SystemExit(main())
