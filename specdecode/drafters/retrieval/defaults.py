"""What building a datastore defaults to, apart from the code that builds one: the command line shows these
without importing numpy."""

DEFAULT_PATTERN = "**/*.py"  # the files of a corpus folder that are indexed
DEFAULT_MAX_TOKENS = 100_000_000  # the largest corpus, in tokens: about 1.5 GiB while sorting
