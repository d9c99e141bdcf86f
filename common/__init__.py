"""What every service does alike: config, logging, metrics, server lifecycle."""
