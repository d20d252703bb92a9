"""The one exception type users see: it says what is wrong and what to do."""


class PrecastError(Exception):
    """A problem with the user's input (checkpoint, engine, flags), stated plainly.

    Raised instead of letting a KeyError or a numpy shape error escape, so the CLI
    can print the message without a traceback.
    """
