"""Errors that reach the user as one line and exit code 2."""


class UsageError(ValueError):
    """Bad input from the user: flags, config, files. Printed as one line, exit 2."""
