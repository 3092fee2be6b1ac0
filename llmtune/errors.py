"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class LlmtuneError(Exception):
    """A problem with the user's input (file, flag, data) rather than a bug.

    The message should name the file (or flag) and the problem in one line.
    """
