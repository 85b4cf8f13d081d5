"""The one exception type for problems a user can cause and fix."""


class ActdesignError(Exception):
    """Bad input: an unknown activation, a malformed spec, an unreadable file, and so on.

    The message is a single line meant for the user; the CLI prints it and exits with code 2.
    """


class TooSlow(ActdesignError):
    """A time bound on what a user wrote fired (sympy on an expression): always an error,
    never a module left alone or a policy applied otherwise. What ships with actdesign (the
    built-in activations, their tables) takes no bounded path."""
