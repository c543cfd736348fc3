"""Errors a user can act on: printed as one line, without a traceback, by the CLI and pretrain.py."""


class UserError(Exception):
    """Bad input (config, plan, model id, allocation): the message names what and says what to do."""
