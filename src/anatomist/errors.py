"""Errors a user can fix: the CLI prints their message on one line and exits with code 2."""


class InputError(ValueError):
    """Bad input from the user: an unknown name, a contradictory flag, a malformed file."""
