"""Tools beside the engine service: model preparation and a command-line engine client."""
