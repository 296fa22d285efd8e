"""The two settings ``liubai logs`` offers on its command line, in a module that imports nothing.

They live here, not in the report modules, so that building the parser (``--help``, a usage
error) imports no torch: the reports read the store, whose package imports the runtime.
"""

EXPORT_FORMATS = ("jsonl", "csv")  # `logs export --format`
DEFAULT_THRESHOLD = 2048  # `logs slope --threshold`: a session is long past this many tokens
