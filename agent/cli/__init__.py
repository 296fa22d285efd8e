"""The ``liubai`` command line: one module per command."""
