"""The one exception type for problems a user can cause and fix."""


class ActdesignError(Exception):
    """Bad input: an unknown activation, a malformed spec, an unreadable file, and so on.

    The message is a single line meant for the user; the CLI prints it and exits with code 2.
    """
