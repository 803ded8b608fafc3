"""The one exception type rdkv raises for misuse it can explain."""


class RDKVError(ValueError):
    """Bad input or a state rdkv cannot serve; the message says what was wrong and what to do."""
