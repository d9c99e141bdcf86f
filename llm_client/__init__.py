"""llm-client, the command line of the stack: stream completions, admin the limits.

``cli`` (the entry point: arguments, chat and prompt), ``admin`` (the admin calls),
``admin_args`` (the admin sub-commands and their flag parsers), ``transport`` (TLS,
trusted CAs and keys).
"""
