"""Errors a user can cause and fix: the CLI prints them without a traceback and exits non-zero."""


class UserError(Exception):
    """Bad input named by field or file; the message says what to change."""
