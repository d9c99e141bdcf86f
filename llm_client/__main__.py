"""``python -m llm_client``: the same as the ``llm-client`` command."""

from llm_client.cli import main

raise SystemExit(main())
