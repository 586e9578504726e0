"""Errors that reach the user as one line and exit code 2."""


class UsageError(ValueError):
    """Bad input from the user: flags, config, files. Printed as one line, exit 2."""


class StoppedAtRound(Exception):
    """The operator asked a run to stop (``RUN/STOP``): it stopped after a completed round
    and its checkpoint, with no round in flight, so ``--resume`` charges nothing twice.
    Printed as one line, exit 3."""


class ClientFailure(RuntimeError):
    """A client could not complete a stage (crash, timeout, rejected update). The
    round goes on without it where the method allows; programming errors are not
    ClientFailures and propagate."""
