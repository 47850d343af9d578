"""The one exception type users see: its message is a single line that names the culprit."""


class ClozeMathError(Exception):
    """A problem with the user's input (config, data, model path). The CLI prints it as one line, no traceback."""
